"""`gagpo-learner` CLI and configuration: help, one-line errors, options that reach training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gagpo.learner.cli import learner_command
from gagpo.learner.config import LearnerConfig
from gagpo.learner.metrics import read_metrics
from gagpo.learner.train import train
from gagpo.schemas.config import load_config
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from tests.helpers.learner import ROOT, parameters, tiny_config, tiny_model_dir, write_shards

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_help_explains_every_option_without_importing_torch():
    code = (
        "import sys; from gagpo.learner.cli import learner_command; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    result = CliRunner().invoke(learner_command, ["--help"])
    assert result.exit_code == 0
    for option in learner_command.params:
        if option.name != "help":
            assert option.help, option.name
    for flag in (
        "--store",
        "--policy",
        "--config",
        "--updates",
        "--batch-groups",
        "--max-staleness",
        "--resume",
        "--replay",
        "--estimator",
    ):
        assert flag in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-groups", "0"], "config field 'batch_groups'"),
        (["--mini-batches", "9"], "config field 'mini_batches'"),
        (["--estimator", "ppo"], "config field 'estimator'"),
        (["--device", "tpu"], "config field 'device'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "gagpo.learner.cli", "--store", str(tmp_path), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.count("\n") == 1 and message in proc.stderr and "Traceback" not in proc.stderr
    )


def test_toml_config_with_estimator_table(tmp_path: Path):
    path = tmp_path / "learner.toml"
    path.write_text(
        '[learner]\nstore = "x"\nbatch_groups = 4\n[learner.estimator]\nlam = 0.5\n'
        "[learner.loss]\nbypass = true\n"
    )
    config = load_config(LearnerConfig, path, section="learner", overrides={"updates": 3})
    assert config.estimator.estimator == "gagpo" and config.estimator.lam == 0.5
    assert config.loss.bypass and config.updates == 3 and config.batch_groups == 4


def test_an_old_config_with_checkpoint_every_gets_one_line(tmp_path: Path):
    path = tmp_path / "learner.toml"
    path.write_text('[learner]\nstore = "x"\ncheckpoint_every = 10\n')
    with pytest.raises(GagpoError) as caught:
        load_config(LearnerConfig, path, section="learner")
    message = str(caught.value)
    assert "'checkpoint_every' was removed" in message and "\n" not in message
    assert "learner/checkpoints/v<N>/" in message
    result = CliRunner().invoke(learner_command, ["--store", "x", "--checkpoint-every", "2"])
    assert result.exit_code == 2 and "No such option '--checkpoint-every'" in result.output


def test_a_policy_that_is_not_a_model_folder_is_one_line(tmp_path: Path):
    with pytest.raises(GagpoError, match="Hugging Face model folder"):
        train(LearnerConfig(store=str(tmp_path / "s"), policy=str(tmp_path)))


@pytest.mark.parametrize(
    "options",
    [
        {"mini_batches": 2, "loss": {"kl_coef": 0.1, "entropy_coef": 0.01, "ratio_level": "token"}},
        {"loss": {"bypass": True, "aggregation": "token_mean"}, "estimator": {"estimator": "grpo"}},
        {"lora": {"enabled": True, "rank": 2}, "loss": {"ratio_level": "sequence"}},
    ],
    ids=["minibatches-kl-entropy-token", "bypass-tokenmean-grpo", "lora-sequence"],
)
def test_objective_variants_train(tmp_path: Path, options):
    store = Store(str(tmp_path / "store"))
    write_shards(store, 2)
    cfg = tiny_config(store, max_staleness=10, **options)
    assert train(cfg).updates == 2
    metrics = read_metrics(store)
    assert np.isfinite(metrics["loss"].to_numpy()).all() and (metrics["masked_actions"] == 0).all()
    if cfg.mini_batches > 1:  # the second step sees π_θ ≠ π_prox
        assert (metrics["approx_kl"] > 0).all()
    before, after = parameters(tiny_model_dir()), parameters(store.policies.dir(2))
    assert before.keys() == after.keys()
    assert any(not np.array_equal(before[k], after[k]) for k in before)


def test_replay_trains_offline_from_another_store(tmp_path: Path):
    source = Store(str(tmp_path / "source"))
    write_shards(source, 3, version=7)  # any age: no staleness drop in replay
    result = CliRunner().invoke(
        learner_command,
        [
            "--store",
            str(tmp_path / "out"),
            "--policy",
            str(tiny_model_dir()),
            "--replay",
            source.url,
            "--updates",
            "10",
            "--batch-groups",
            "4",
            "--estimator",
            "gigpo",
            "--quiet",
        ],
    )
    assert result.exit_code == 3, result.output  # fewer updates than asked: the data ran out
    assert "2 update(s) done" in result.output and "6 group(s) trained" in result.output
    assert "stopped after 2 of 10 updates: every shard of" in result.output
    out = Store(str(tmp_path / "out"))
    assert out.policies.latest() == 2 and not out.list_shards()
    assert out.fs.glob(out.path("advantages", "gigpo-*", "*.parquet"))


def test_non_finite_and_huge_inputs_are_masked_or_bounded(tmp_path: Path):
    """A NaN behaviour log-prob never reaches the store (the writer refuses it; a shard
    written around it is quarantined: test_shard_bounds.py), and the loss masks what gets
    that far (test_loss.py). The most negative log-prob a shard may hold still gives a
    bounded weight: log w is huge, w is truncated at C, nothing becomes inf."""
    import pyarrow as pa

    from gagpo.schemas import columns as C
    from gagpo.schemas.validate import MIN_LOGPROB, ValidationError
    from tests.helpers.learner import GROUP_SIZE, shard_table

    store = Store(str(tmp_path / "store"))
    table = shard_table("bad", groups=2)
    behav = table[C.BEHAVIOR_LOGPROBS].to_pylist()
    i = table.schema.get_field_index(C.BEHAVIOR_LOGPROBS)

    def with_behaviour(rows):
        return table.set_column(i, table.schema.field(i), pa.array(rows, pa.list_(pa.float32())))

    nan = [[float("nan")] * len(behav[0]), *behav[1:]]
    with pytest.raises(ValidationError, match="behavior_logprobs holds nan"):
        store.write_shard(with_behaviour(nan), group_size=GROUP_SIZE)
    huge = [behav[0], [MIN_LOGPROB] * len(behav[1]), *behav[2:]]  # log w ≈ 1000
    store.write_shard(with_behaviour(huge), group_size=GROUP_SIZE)
    cfg = LearnerConfig(
        store=store.url,
        policy=str(tiny_model_dir()),
        updates=1,
        batch_groups=2,
        idle_timeout_s=0.5,
        poll_interval_s=0.05,
    )
    assert train(cfg).updates == 1
    row = read_metrics(store).row(0, named=True)
    assert row["masked_actions"] == 0 and row["behavior_weight_max"] == pytest.approx(2.0)
    assert np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]) and row["skipped_steps"] == 0
    assert all(np.isfinite(v).all() for v in parameters(store.policies.dir(1)).values())

"""`gagpo advantages`: plain Parquet files and store shards in, advantages tables out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from polars.testing import assert_frame_equal

from gagpo.pipeline import compute_advantages, parse_estimator_config
from gagpo.pipeline.cli import advantages
from gagpo.schemas import columns as C
from gagpo.storage.store import Store
from tests.helpers.advantages import rollout, steps_frame
from tests.helpers.steps import make_steps

GROUP_A = {"a": [rollout("xyz", [0, 0, 1]), rollout("xy", [0, 1], "truncated", "z")]}
GROUP_B = {"b": [rollout("pq", [1, 0]), rollout("p", [0.5], "truncated", "unseen")]}


def write(path: Path, frame: pl.DataFrame) -> str:
    frame.write_parquet(path)
    return str(path)


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it (separate process: exit code, stderr, no traceback)."""
    return subprocess.run(
        [sys.executable, "-m", "gagpo.pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )


def test_files_to_parquet_with_metadata_and_diagnostics(tmp_path):
    src = write(tmp_path / "steps.parquet", steps_frame(GROUP_A | GROUP_B))
    out = tmp_path / "out" / "adv.parquet"
    result = CliRunner().invoke(
        advantages,
        [
            "--input",
            src,
            "--out",
            str(out),
            "--estimator",
            "gagpo",
            "--lam",
            "0.5",
            "--omega",
            "0.2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"wrote 8 steps to {out}" in result.output
    assert "singleton_state_rate" in result.output and "per group" in result.output
    meta = pq.read_schema(out).metadata
    assert meta[C.META_ESTIMATOR] == b"gagpo"
    params = json.loads(meta[C.META_ESTIMATOR_PARAMS])
    assert params == {"gamma": 0.95, "lam": 0.5, "norm": "group", "eps": 1e-6, "omega_episode": 0.2}
    written = pl.read_parquet(out)
    config = parse_estimator_config({"lam": 0.5, "omega_episode": 0.2})
    expected = compute_advantages(pl.scan_parquet(src), config).collect()
    assert_frame_equal(written, expected)
    assert pq.read_schema(out).remove_metadata().equals(C.ADVANTAGES_SCHEMA)
    assert [p.name for p in out.parent.iterdir()] == ["adv.parquet"]  # no temporary left


def test_glob_processes_each_file_as_its_own_batch(tmp_path):
    write(tmp_path / "part-1.parquet", steps_frame(GROUP_A))
    write(tmp_path / "part-2.parquet", steps_frame(GROUP_B))
    out = tmp_path / "adv.parquet"
    result = CliRunner().invoke(
        advantages,
        [
            "--input",
            str(tmp_path / "part-*.parquet"),
            "--out",
            str(out),
            "--norm",
            "batch",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    config = parse_estimator_config({"norm": "batch"})
    per_file = [
        compute_advantages(pl.scan_parquet(tmp_path / f"part-{i}.parquet"), config).collect()
        for i in (1, 2)
    ]
    assert_frame_equal(pl.read_parquet(out), pl.concat(per_file))


def test_toml_config_and_flag_override(tmp_path):
    src = write(tmp_path / "steps.parquet", steps_frame(GROUP_A))
    cfg = tmp_path / "adv.toml"
    cfg.write_text(
        f'[advantages]\nestimator = "gigpo"\nomega = 0.5\nstep_std = false\ninput = "{src}"\n'
        f'out = "{tmp_path / "adv.parquet"}"\n'
    )
    result = CliRunner().invoke(advantages, ["--config", str(cfg), "--omega", "0.25", "--quiet"])
    assert result.exit_code == 0, result.output
    params = json.loads(pq.read_schema(tmp_path / "adv.parquet").metadata[C.META_ESTIMATOR_PARAMS])
    assert params["omega"] == 0.25 and params["step_std"] is False


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    good = steps_frame(GROUP_A | GROUP_B)
    cases = {
        "missing column": (good.drop(C.REWARD), "missing column(s) reward"),
        "duplicate step": (pl.concat([good, good[:1]]), "duplicate (traj_id, step) = ('a/r0', 0)"),
        "gap in step": (
            good.filter(pl.col(C.STEP) != 1),
            "gap in step: rollout 'a/r0' has no step 1",
        ),
        "nan reward": (
            good.with_columns(
                pl.when(pl.col(C.STEP) == 1)
                .then(float("nan"))
                .otherwise(pl.col(C.REWARD))
                .alias(C.REWARD)
            ),
            "column reward holds nan at row 1 (traj_id 'a/r0', step 1)",
        ),
    }
    out = {}
    for name, (frame, message) in cases.items():
        out[name] = ([write(tmp_path / f"{name.replace(' ', '-')}.parquet", frame)], message)
    # One group split over two files given separately.
    a = steps_frame(GROUP_A)
    first = write(tmp_path / "split-1.parquet", a.filter(pl.col(C.TRAJ_ID) == "a/r0"))
    second = write(tmp_path / "split-2.parquet", a.filter(pl.col(C.TRAJ_ID) == "a/r1"))
    out["group over two files"] = (
        [first, second],
        f"group 'a' is spread over {first} and {second}",
    )
    not_parquet = tmp_path / "notes.parquet"
    not_parquet.write_text("hello")
    out["not parquet"] = ([str(not_parquet)], "not a readable Parquet file")
    return out


def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path):
    out = tmp_path / "adv.parquet"
    for name, (files, message) in bad_inputs(tmp_path).items():
        args = [arg for f in files for arg in ("--input", f)]
        proc = cli(*args, "--out", str(out))
        assert proc.returncode == 2, (name, proc.stderr)
        assert "Traceback" not in proc.stderr, name
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (name, proc.stderr)
        assert not out.exists(), name
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")], name


def test_failure_leaves_an_existing_output_untouched(tmp_path):
    out = tmp_path / "adv.parquet"
    out.write_bytes(b"previous")
    bad = write(tmp_path / "bad.parquet", steps_frame(GROUP_A).drop(C.DONE))
    proc = cli("--input", bad, "--out", str(out))
    assert proc.returncode == 2 and out.read_bytes() == b"previous"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--estimator", "ppo"], "unknown estimator 'ppo'; accepted: gagpo, gagpo_lambda0"),
        (["--estimator", "grpo", "--omega", "1"], "--omega does not apply to estimator grpo"),
        (["--estimator", "gigpo", "--lam", "0.5"], "estimator gigpo has no parameter 'lam'"),
        (
            ["--gamma", "1.5"],
            "estimator parameter 'gamma': Input should be less than or equal to 1",
        ),
        (["--norm", "zscore"], "'group', 'batch', 'none' or 'mean'"),
        (["--gamma", "abc"], "'gamma'"),
        ([], "missing --input/--out or --store"),
        (["--input", "nothing-here-*.parquet", "--out", "x.parquet"], "matches no file"),
        (["--store", "x", "--input", "y"], "either --store or --input/--out"),
    ],
)
def test_bad_flags_are_one_line(args, message):
    proc = cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# --- store mode ------------------------------------------------------------------------


def test_store_mode_writes_one_table_per_shard(store_dir):
    store = Store(str(store_dir))
    refs = [
        store.write_shard(
            make_steps(run_id="r1", shard_id="s1", groups=2, group_size=3), group_size=3
        ),
        store.write_shard(
            make_steps(run_id="r1", shard_id="s2", groups=1, group_size=3), group_size=3
        ),
        store.write_shard(
            make_steps(run_id="r2", shard_id="s3", groups=1, group_size=3), group_size=3
        ),
    ]
    result = CliRunner().invoke(
        advantages, ["--store", str(store_dir), "--run", "r1", "--estimator", "grpo"]
    )
    assert result.exit_code == 0, result.output
    config = parse_estimator_config({"estimator": "grpo"})
    folder = store_dir / "advantages" / config.tag
    assert sorted(p.name for p in folder.iterdir()) == ["s1.parquet", "s2.parquet"]
    assert f"wrote 2 shard table(s), {2 * 9 + 9} steps" in result.output
    for ref in refs[:2]:
        written = pl.read_parquet(folder / f"{ref.shard_id}.parquet")
        steps = pl.read_parquet(ref.path).select(C.ADVANTAGE_INPUT_COLUMNS)
        assert_frame_equal(written, compute_advantages(steps.lazy(), config).collect())
        assert (
            pq.read_schema(folder / f"{ref.shard_id}.parquet").metadata[C.META_ESTIMATOR] == b"grpo"
        )


def test_store_mode_quarantines_a_bad_shard_and_goes_on(store_dir):
    store = Store(str(store_dir))
    good = store.write_shard(make_steps(run_id="r", shard_id="good"), group_size=3)
    bad = store.write_shard(make_steps(run_id="r", shard_id="bad"), group_size=3)
    Path(bad.path).write_bytes(Path(bad.path).read_bytes()[:100])  # a torn file
    result = CliRunner().invoke(advantages, ["--store", str(store_dir), "--quiet"])
    assert result.exit_code == 0, result.output
    assert f"quarantined {bad.path}: unreadable Parquet file" in result.stderr
    tag = parse_estimator_config({}).tag
    assert os.listdir(store_dir / "advantages" / tag) == ["good.parquet"]
    assert [q["original_path"] for q in store.quarantined()] == [bad.path]
    assert good.path in [r.path for r in store.list_shards()]


def test_store_mode_without_shards_is_an_error(store_dir):
    proc = cli("--store", str(store_dir), "--run", "nope")
    assert proc.returncode == 2 and "no committed shard under" in proc.stderr


def test_config_file_is_read_by_load_config(tmp_path):
    """[advantages] is validated as a model: a bad command field is one line naming it, and
    --set sits between the file and the flags."""
    cfg = tmp_path / "adv.toml"
    cfg.write_text("[advantages]\nout = 3\n")
    result = CliRunner().invoke(advantages, ["--config", str(cfg)])
    assert result.exit_code != 0 and "config field 'out'" in str(result.exception)
    src = write(tmp_path / "steps.parquet", steps_frame(GROUP_A))
    cfg.write_text(
        f'[advantages]\nlam = 0.3\ngamma = 0.5\ninput = ["{src}"]\nout = "{tmp_path / "a.parquet"}"\n'
    )
    args = [
        "--config",
        str(cfg),
        "--set",
        "lam=0.6",
        "--set",
        "gamma=0.7",
        "--gamma",
        "0.9",
        "--quiet",
    ]
    result = CliRunner().invoke(advantages, args)
    assert result.exit_code == 0, result.output
    params = json.loads(pq.read_schema(tmp_path / "a.parquet").metadata[C.META_ESTIMATOR_PARAMS])
    assert params["lam"] == 0.6 and params["gamma"] == 0.9

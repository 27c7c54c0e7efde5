"""Tracker sinks and the console line: a short learner run writes TensorBoard events with
the update metrics (read back with TensorBoard's own reader), NULL for what it did not
compute, and one line per update with n/N and the time left."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gagpo.learner.config import LearnerConfig
from gagpo.learner.metrics import clip_possible, not_computed, progress_line, read_metrics
from gagpo.learner.sinks import check_trackers
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from tests.helpers.learner import tiny_config, write_shards

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_the_update_metrics_and_nulls_stay_out(tmp_path):
    pytest.importorskip("tensorboard")
    from gagpo.learner.train import train

    store = Store(str(tmp_path / "store"))
    write_shards(store, 2)
    cfg = tiny_config(store, max_staleness=10, log_to=["tensorboard"])
    lines: list[str] = []
    assert train(cfg, echo=lines.append).updates == 2

    metrics = read_metrics(store)
    assert metrics["entropy"].null_count() == 2 and metrics["kl_ref"].null_count() == 2
    events = _events(tmp_path / "store" / "learner" / "tensorboard")
    for name in ("loss", "pg_loss", "grad_norm", "lr", "tokens_per_s", "behavior_weight_mean"):
        assert [step for step, _ in events[name]] == [1, 2], name
        assert [v for _, v in events[name]] == pytest.approx(metrics[name].to_list(), rel=1e-6)
    assert "entropy" not in events and "kl_ref" not in events  # not computed: not 0

    update_lines = [line for line in lines if line.startswith("update ")]
    assert len(update_lines) == 2
    assert update_lines[0].startswith("update 1/2 → v1  ETA ")
    assert "tok/s" in update_lines[0] and "staleness 0.0" in update_lines[0]
    assert "clip" not in update_lines[0]  # one mini-batch, no bypass: 0 by construction
    assert "entropy" not in update_lines[0]


def test_what_is_computed_follows_the_settings():
    cfg = LearnerConfig(store="s")
    assert not_computed(cfg) == ("entropy", "kl_ref") and not clip_possible(cfg)
    cfg = LearnerConfig(store="s", mini_batches=2, loss={"entropy_coef": 0.01, "kl_coef": 0.1})
    assert not_computed(cfg) == () and clip_possible(cfg)
    row = {
        "update": 3,
        "version": 3,
        "loss": 0.5,
        "entropy": 1.25,
        "kl_ref": 0.01,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "behavior_weight_mean": 0.99,
        "behavior_weight_max": 1.3,
        "mismatch_kl": 2e-4,
        "clip_frac": 0.125,
        "approx_kl": 0.003,
        "grad_norm": 0.7,
        "lr": 1e-3,
        "tokens_per_s": 1234.0,
        "groups": 4,
        "stale_groups": 1,
        "masked_actions": 0,
    }
    line = progress_line(row, total=10, eta_s=3725, clip=True)
    assert line.startswith("update 3/10 → v3  ETA 1:02:05  loss +0.5000  entropy 1.250")
    assert "mismatch 2.0e-04" in line and "clip 0.125" in line and "masked" not in line


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_a_tracker_that_is_not_installed_is_one_line():
    with pytest.raises(GagpoError, match=r"needs the wandb package.*pip install 'gagpo\[wandb\]'"):
        check_trackers(["wandb"])


def test_wandb_runs_offline_without_a_key_and_gets_the_same_names(tmp_path, monkeypatch):
    """A stand-in `wandb` module records what the sink asks of it (the real package is an
    optional extra, not installed for the tests)."""
    import importlib.machinery
    import sys
    import types

    from gagpo.learner.sinks import open_sinks, scalars

    calls: dict[str, list] = {"init": [], "log": [], "finish": []}
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class FakeRun:
        def log(self, metrics, step):
            calls["log"].append((metrics, step))

        def finish(self):
            calls["finish"].append(True)

    def init(**kwargs):
        calls["init"].append(kwargs)
        return FakeRun()

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (sink,) = open_sinks(["wandb"], tmp_path / "runs", run_name="r1", config={"lr": 0.1})
    row = {"loss": 0.5, "entropy": None, "tokens": 7, "grad_norm": float("nan")}
    sink.log(scalars(row), 3)
    sink.close()
    assert calls["init"][0]["mode"] == "offline" and calls["init"][0]["config"] == {"lr": 0.1}
    assert calls["log"] == [({"loss": 0.5, "tokens": 7.0}, 3)]  # NULL and NaN left out
    assert calls["finish"] == [True]

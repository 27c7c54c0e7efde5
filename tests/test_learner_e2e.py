"""The learner end to end on a temporary store with a tiny model: updates, publication,
metrics, checkpoints, exact resume, and a SIGKILL mid-update followed by --resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
import zarr

from gagpo.learner.config import LearnerConfig
from gagpo.learner.feed import TRAINED, Ledger
from gagpo.learner.metrics import METRIC_COLUMNS, read_metrics
from gagpo.learner.train import train
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.layout import COMPLETE
from gagpo.storage.store import Store
from tests.helpers.learner import parameters, run_learner, tiny_model_dir, write_shards
from tests.helpers.lineage import kill_at, lineage_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHARDS, GROUPS_PER_SHARD, B = 5, 2, 2  # 10 groups: 5 updates of 2 groups


def config(store: Path, **kw) -> LearnerConfig:
    base = dict(
        store=str(store),
        policy=str(tiny_model_dir()),
        updates=5,
        batch_groups=B,
        lr=3e-3,
        micro_batch_tokens=96,
        keep_versions=100,
        poll_interval_s=0.05,
        idle_timeout_s=1.0,
        max_staleness=100,
    )
    return LearnerConfig(**(base | kw))


def fresh_store(tmp_path: Path, name: str) -> Store:
    store = Store(str(tmp_path / name))
    write_shards(store, SHARDS, groups=GROUPS_PER_SHARD)
    return store


def assert_same_parameters(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=atol, rtol=0, err_msg=name)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run: the reference for every resumed one."""
    root = tmp_path_factory.mktemp("straight")
    store = fresh_store(root, "store")
    summary = train(config(root / "store", keep_versions=2))
    return store, summary


def test_updates_publish_versions_and_record_everything(straight):
    store, summary = straight
    assert summary.updates == 5 and summary.version == 5 and summary.groups == 10
    assert store.policies.latest() == 5 and store.policies.folders() == [4, 5]
    v5 = store.policies.dir(5)
    assert store.fs.exists(f"{v5}/{COMPLETE}") and store.fs.exists(f"{v5}/tokenizer.json")
    before, after = parameters(tiny_model_dir()), parameters(v5)
    assert any(not np.array_equal(before[k], after[k]) for k in before)  # it learned something
    metrics = read_metrics(store)
    assert metrics.columns == list(METRIC_COLUMNS) and metrics["update"].to_list() == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert metrics["groups"].sum() == 10 and (metrics["masked_actions"] == 0).all()
    assert np.isfinite(metrics["loss"].to_numpy()).all() and (metrics["grad_norm"] > 0).all()
    hist = zarr.open_group(store.path("learner", "histograms.zarr"), mode="r")
    # Data of version 0 trained by the learner at version u − 1: staleness u − 1.
    assert hist["staleness"].shape == (5, 102)
    assert [int(hist["staleness"][u, u]) for u in range(5)] == [B] * 5
    assert hist["advantage"][:].sum() == metrics["actions"].sum()
    ledger = Ledger.load(store).table()
    assert ledger.num_rows == 10 and set(ledger["status"].to_pylist()) == {TRAINED}
    assert len(store.fs.glob(store.path("advantages", "*", "*.parquet"))) == SHARDS
    # A second run on the same store without --resume refuses, with one line.
    with pytest.raises(GagpoError, match="--resume"):
        train(config(Path(store.root)))


def test_resume_continues_exactly(straight, tmp_path: Path):
    store = fresh_store(tmp_path, "store")
    train(config(tmp_path / "store", updates=2))
    summary = train(config(tmp_path / "store", resume=True))
    assert summary.updates == 5 and summary.groups == 6
    assert_same_parameters(
        parameters(store.policies.dir(5)), parameters(straight[0].policies.dir(5))
    )


@pytest.mark.slow
@pytest.mark.parametrize(("phase", "update"), [("backward", 4), ("publish", 3)])
def test_sigkill_then_resume(straight, tmp_path: Path, phase, update):
    store = fresh_store(tmp_path, "store")
    # A state with every version, before LATEST moves: the resume is exact (issue 40)
    every_version = ("--state-every", "1", "--no-state-async")
    kill_at(tmp_path / "store", f"{phase}:{update}", tmp_path, *every_version, updates=5)
    latest = store.policies.latest()
    # LATEST never names an incomplete version.
    assert latest == update - 1 and store.fs.exists(f"{store.policies.dir(latest)}/{COMPLETE}")
    resumed = run_learner(*lineage_args(tmp_path / "store", "--resume", updates=5))
    assert resumed.returncode == 0, resumed.stderr
    versions = store.policies.folders()
    assert versions == list(range(1, versions[-1] + 1)) and store.policies.latest() == versions[-1]
    assert all(store.fs.exists(f"{store.policies.dir(v)}/{COMPLETE}") for v in versions)
    # Every group trained exactly once in the final lineage, and the same model as a run
    # that was never interrupted.
    ledger = pl.from_arrow(Ledger.load(store).table())
    assert ledger.height == 10 and ledger[C.GROUP_ID].n_unique() == 10
    assert ledger["update"].to_list() == sorted(ledger["update"].to_list())
    assert read_metrics(store)["groups"].sum() == 10
    assert_same_parameters(
        parameters(store.policies.dir(versions[-1])), parameters(straight[0].policies.dir(5))
    )


# --- no hangs (issue 14, case 5): each fails with one line, exit 2 ----------------------
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--policy", "nosuchpolicy"), "neither a preset nor a folder; accepted: tiny"),
        (("--resume",), "missing or empty, nothing to resume"),
        (("--resume", "--store", "{tmp}/missing"), "missing or empty, nothing to resume"),
        (("--replay", "/nonexistent"), "holds no committed shard"),
        (("--idle-timeout", "1"), "did not appear within 1s"),
    ],
)
def test_no_hang_one_line(tmp_path: Path, args, words):
    """These used to wait forever for the actors to publish v0."""
    (tmp_path / "empty").mkdir()
    args = [a.format(tmp=tmp_path) for a in args]
    store = [] if "--store" in args else ["--store", str(tmp_path / "empty")]
    done = run_learner(*store, *args, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if "error" in line]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in done.stderr, done.stderr
    if "--idle-timeout" in args:  # and it said what it was waiting for
        assert "waiting for the actors to publish base policy 'tiny'" in done.stderr

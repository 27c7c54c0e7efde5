"""One lineage across learner kills (issue 14, case 1): after a SIGKILL and --resume,
versions rise by one per update, each the child of the one before (lineage records), no
published version is discarded, and every group is trained exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gagpo.learner.config import LearnerConfig
from gagpo.learner.state import checkpoint_dir
from gagpo.learner.train import train
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.layout import COMPLETE, LINEAGE
from gagpo.storage.store import Store
from tests.helpers.learner import parameters, tiny_model_dir, write_shards
from tests.helpers.lineage import UPDATES, B, assert_one_lineage, kill_at, resume

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The same run, never interrupted: the reference weights."""
    root = tmp_path_factory.mktemp("straight") / "store"
    store = new_store(root)
    cfg = LearnerConfig(
        store=str(root),
        policy=str(tiny_model_dir()),
        updates=UPDATES,
        batch_groups=B,
        max_staleness=100,
        lr=3e-3,
        micro_batch_tokens=96,
        keep_versions=100,
        poll_interval_s=0.05,
        idle_timeout_s=1.0,
    )
    train(cfg)
    return store


def new_store(root: Path) -> Store:
    store = Store(str(root))
    write_shards(store, UPDATES, groups=B)
    store.policies.publish_base(str(tiny_model_dir()))  # v0, as actors publish it
    store.policies.set_latest(0)
    return store


# A state with every version, written before LATEST moves: v7's own state is complete
# when update 8 is killed, so the resumed run is the uninterrupted one bit for bit.
EVERY_VERSION = ("--state-every", "1", "--no-state-async")


def test_kill_mid_update_then_resume_continues_latest(straight, tmp_path):
    """The issue's case: killed in update 8's backward, while v7 may still be written by
    the publishing thread (LATEST 7, or 6 with v7's folder unmarked); the resumed run
    makes the child of LATEST from its own weights and state, so update u → version u
    throughout."""
    store = new_store(tmp_path / "store")
    kill_at(tmp_path / "store", "backward:8", tmp_path, *EVERY_VERSION)
    latest = store.policies.latest()
    assert latest in (6, 7)
    parent = json.loads(store.fs.cat_file(f"{store.policies.dir(latest)}/{LINEAGE}"))
    resume(tmp_path / "store")
    assert_one_lineage(store)
    child = json.loads(store.fs.cat_file(f"{store.policies.dir(latest + 1)}/{LINEAGE}"))
    assert (child["parent"], child["parent_id"]) == (latest, parent["id"])
    assert child["update"] == latest + 1
    # Bit-for-bit the uninterrupted lineage (restored optimiser, scheduler, RNG, ledger).
    a, b = parameters(store.policies.dir(UPDATES)), parameters(straight.policies.dir(UPDATES))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-6, rtol=0, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("hold", ["checkpoint:3", "publish:3", "backward:1"])
def test_kill_around_publication_then_resume(straight, tmp_path, hold):
    """Killed with the state written but the policy not (checkpoint), with the policy's
    files written but not marked complete by the publishing thread while update 4 runs
    and then waits for it (publish), or before any publication."""
    store = new_store(tmp_path / "store")
    kill_at(tmp_path / "store", hold, tmp_path, *EVERY_VERSION)
    update = int(hold.split(":")[1])
    assert store.policies.latest() == update - 1
    resume(tmp_path / "store")
    assert_one_lineage(store)
    assert not store.fs.exists(checkpoint_dir(store, 1))  # pruned: states of the newest 2 kept
    a, b = parameters(store.policies.dir(UPDATES)), parameters(straight.policies.dir(UPDATES))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-6, rtol=0, err_msg=name)


def in_process(root: Path) -> dict:
    """The settings of a learner trained in this process on `new_store(root)`."""
    return dict(
        store=str(root),
        policy=str(tiny_model_dir()),
        batch_groups=B,
        lr=3e-3,
        micro_batch_tokens=96,
        poll_interval_s=0.05,
        idle_timeout_s=0.5,
    )


def test_resume_without_any_state_continues_latest_with_a_fresh_optimiser(tmp_path):
    """A LATEST with no complete state at or before it (killed before its first state was
    written; here removed) continues from its own weights with a fresh AdamW, and says so:
    no restart from base weights under a later version number. A store without the
    learner's ledger (versions of another learner) is refused, resumed or fresh."""
    root = tmp_path / "store"
    store = new_store(root)
    cfg = in_process(root)
    train(LearnerConfig(**cfg, updates=2))
    assert store.fs.exists(f"{checkpoint_dir(store, 2)}/{COMPLETE}")  # the run's closing state
    store.fs.rm(checkpoint_dir(store, 2), recursive=True)
    lines: list[str] = []
    summary = train(LearnerConfig(**cfg, updates=3, resume=True), echo=lines.append)
    assert summary.updates == 3 and store.policies.latest() == 3
    assert any("no complete training state at or before v2" in line for line in lines), lines
    v2 = json.loads(store.fs.cat_file(f"{store.policies.dir(2)}/{LINEAGE}"))
    v3 = json.loads(store.fs.cat_file(f"{store.policies.dir(3)}/{LINEAGE}"))
    assert (v3["parent"], v3["parent_id"], v3["update"]) == (2, v2["id"], 3)
    store.fs.rm(store.path("learner"), recursive=True)
    with pytest.raises(GagpoError, match="v3 but the store holds no lineage record or ledger"):
        train(LearnerConfig(**cfg, updates=4, resume=True))
    with pytest.raises(GagpoError, match="versions up to v3 but no learner state"):
        train(LearnerConfig(**cfg, updates=4))


def test_resume_without_learner_state_says_it_starts_fresh(tmp_path):
    """--resume on a store actors wrote but no learner ever published to: one line says it
    starts from v0 (documented), then it trains as a fresh run does."""
    root = tmp_path / "store"
    new_store(root)
    lines: list[str] = []
    summary = train(LearnerConfig(**in_process(root), updates=1, resume=True), echo=lines.append)
    assert summary.updates == 1
    assert lines[0] == f"--resume: store {root} holds no learner state yet; starting fresh from v0"


def test_a_store_with_a_state_for_every_version_resumes_as_before(straight, tmp_path):
    """Stores written before states became periodic (issue 40) hold fp32 weights and a
    state with every version, written before LATEST moved, as `--state-every 1
    --no-state-async --no-publish-async --publish-dtype fp32` writes them: --resume
    reads LATEST's own state, and the run is the uninterrupted lineage bit for bit (a
    store written by the learner of before the change was checked the same way by hand:
    benchmarks/RESULTS.md, "Publication and training state")."""
    root = tmp_path / "store"
    store = new_store(root)
    cfg = {**in_process(root), "max_staleness": 100, "keep_versions": 100, "idle_timeout_s": 1.0}
    old = {"state_every": 1, "state_async": False, "publish_async": False}  # all at once
    train(LearnerConfig(**cfg, updates=5, publish_dtype="fp32", **old))
    assert [v for v in range(1, 6) if store.fs.exists(checkpoint_dir(store, v))] == [4, 5]
    assert {t.dtype for t in parameters(store.policies.dir(5)).values()} == {np.dtype("float32")}
    lines: list[str] = []
    train(LearnerConfig(**cfg, updates=UPDATES, resume=True), echo=lines.append)
    assert not any("optimiser moments of" in line or "fresh AdamW" in line for line in lines)
    assert_one_lineage(store)
    a, b = parameters(store.policies.dir(UPDATES)), parameters(straight.policies.dir(UPDATES))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-6, rtol=0, err_msg=name)


@pytest.mark.slow
def test_kill_during_an_asynchronous_state_write_then_resume(tmp_path):
    """Held inside the writer thread's state of v3 (files written, no marker) while the
    learner goes on (LATEST 2 or 3, the next hand-off waits for it): the torn state never
    counts, --resume continues one lineage from LATEST with v2's optimiser state."""
    store = new_store(tmp_path / "store")
    kill_at(tmp_path / "store", "checkpoint:3", tmp_path, "--state-every", "1")
    latest = store.policies.latest()
    assert latest in (2, 3)
    torn = checkpoint_dir(store, 3)
    assert store.fs.exists(torn) and not store.fs.exists(f"{torn}/{COMPLETE}")
    resume(tmp_path / "store")
    assert_one_lineage(store)

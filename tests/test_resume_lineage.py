"""One lineage across learner kills (issue 14, case 1): after a SIGKILL and --resume,
versions rise by one per update, each the child of the one before (lineage records), no
published version is discarded, and every group is trained exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from gagpo.learner.checkpoint import check_lineage, checkpoint_dir
from gagpo.learner.config import LearnerConfig
from gagpo.learner.feed import Ledger
from gagpo.learner.metrics import read_metrics
from gagpo.learner.train import train
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.layout import COMPLETE, LINEAGE
from gagpo.schemas.store import Store
from gagpo.schemas.versions import version_folders
from tests.test_learner_support import (
    ROOT,
    learner_cmd,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    parameters,
    tiny_model_dir,
    write_shards,
)

UPDATES, B = 10, 2


def args(store: Path, *extra: str) -> list[str]:
    """The issue's command, on the tiny policy folder and a store of 20 groups."""
    return ["--store", str(store), "--policy", str(tiny_model_dir()), "--updates", str(UPDATES),
            "--batch-groups", str(B), "--max-staleness", "100",
            "--lr", "3e-3", "--micro-batch-tokens", "96", "--keep-versions", "100",
            "--poll-interval", "0.05", "--idle-timeout", "1", "--quiet", *extra]  # fmt: skip


def kill_at(store: Path, hold: str, tmp_path: Path, *extra: str) -> None:
    """Run the learner (with `extra` arguments) with GAGPO_LEARNER_HOLD=<hold>:<file>;
    SIGKILL it once held."""
    held = tmp_path / "held"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GAGPO_LEARNER_HOLD": f"{hold}:{held}"}
    proc = subprocess.Popen(learner_cmd(*args(store), *extra), cwd=ROOT, env=env,
                            stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not held.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the learner never reached the hold point"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stderr.close()


def resume(store: Path) -> None:
    done = subprocess.run(learner_cmd(*args(store, "--resume")), cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def assert_one_lineage(store: Store, updates: int = UPDATES) -> None:
    assert store.latest_version() == updates
    assert version_folders(store) == list(range(updates + 1))  # v0 from the "actors"
    assert check_lineage(store) == []
    metrics = read_metrics(store)
    assert metrics["update"].to_list() == list(range(1, updates + 1))
    assert metrics["version"].to_list() == list(range(1, updates + 1))
    ledger = pl.from_arrow(Ledger.load(store).table())
    assert ledger.height == updates * B and ledger[C.GROUP_ID].n_unique() == updates * B
    assert ledger.group_by("update").len().sort("update")["len"].to_list() == [B] * updates


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The same run, never interrupted: the reference weights."""
    root = tmp_path_factory.mktemp("straight") / "store"
    store = new_store(root)
    cfg = LearnerConfig(store=str(root), policy=str(tiny_model_dir()), updates=UPDATES,
                        batch_groups=B, max_staleness=100, lr=3e-3, micro_batch_tokens=96,
                        keep_versions=100, poll_interval_s=0.05, idle_timeout_s=1.0)  # fmt: skip
    train(cfg)
    return store


def new_store(root: Path) -> Store:
    store = Store(str(root))
    write_shards(store, UPDATES, groups=B)
    store.publish_base_policy(str(tiny_model_dir()))  # v0, as actors publish it
    store.set_latest(0)
    return store


def test_kill_mid_update_then_resume_continues_latest(straight, tmp_path):
    """The issue's case: killed in update 8's backward (LATEST = 7); the resumed run makes
    v8 from v7's own weights and state, so update u → version u throughout."""
    store = new_store(tmp_path / "store")
    kill_at(tmp_path / "store", "backward:8", tmp_path)
    assert store.latest_version() == 7
    v7 = json.loads(store.fs.cat_file(f"{store.policy_dir(7)}/{LINEAGE}"))
    resume(tmp_path / "store")
    assert_one_lineage(store)
    v8 = json.loads(store.fs.cat_file(f"{store.policy_dir(8)}/{LINEAGE}"))
    assert (v8["parent"], v8["parent_id"], v8["update"]) == (7, v7["id"], 8)
    # Bit-for-bit the uninterrupted lineage (restored optimiser, scheduler, RNG, ledger).
    a, b = parameters(store.policy_dir(UPDATES)), parameters(straight.policy_dir(UPDATES))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-6, rtol=0, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("hold", ["checkpoint:3", "publish:3", "backward:1"])
def test_kill_around_publication_then_resume(straight, tmp_path, hold):
    """Killed with the state written but the policy not (checkpoint), with the policy's
    files written but not marked complete (publish), or before any publication."""
    store = new_store(tmp_path / "store")
    kill_at(tmp_path / "store", hold, tmp_path)
    update = int(hold.split(":")[1])
    assert store.latest_version() == update - 1
    resume(tmp_path / "store")
    assert_one_lineage(store)
    assert not store.fs.exists(checkpoint_dir(store, 1))  # pruned: states of the newest 2 kept
    a, b = parameters(store.policy_dir(UPDATES)), parameters(straight.policy_dir(UPDATES))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-6, rtol=0, err_msg=name)


def test_resume_refuses_a_version_without_its_state(tmp_path):
    """A LATEST whose training state is gone cannot continue its lineage: one line, no
    restart from base weights under a later version number."""
    root = tmp_path / "store"
    store = new_store(root)
    cfg = dict(store=str(root), policy=str(tiny_model_dir()), batch_groups=B, lr=3e-3,
               micro_batch_tokens=96, poll_interval_s=0.05, idle_timeout_s=0.5)  # fmt: skip
    train(LearnerConfig(**cfg, updates=2))
    assert store.fs.exists(f"{checkpoint_dir(store, 2)}/{COMPLETE}")
    store.fs.rm(checkpoint_dir(store, 2), recursive=True)
    with pytest.raises(GagpoError, match=r"v2 but .* no complete training state"):
        train(LearnerConfig(**cfg, updates=3, resume=True))
    # A fresh run on a store whose versions came from another learner refuses too.
    store.fs.rm(store.path("learner"), recursive=True)
    with pytest.raises(GagpoError, match="versions up to v2 but no learner state"):
        train(LearnerConfig(**cfg, updates=3))

"""A learner run killed at a hold point and resumed, and the check that it left one
lineage (tests/test_resume_lineage.py; tests/test_compaction_live.py kills it mid-compaction)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import polars as pl

from gagpo.learner.checkpoint import check_lineage
from gagpo.learner.feed import Ledger
from gagpo.learner.metrics import read_metrics
from gagpo.schemas import columns as C
from gagpo.storage.store import Store
from tests.helpers.learner import ROOT, learner_cmd, run_learner, tiny_learner_args

UPDATES, B = 10, 2


def lineage_args(store: Path, *extra: str, updates: int = UPDATES) -> list[str]:
    """The issue's command, on the tiny policy folder and a store of 20 groups."""
    options = {"lr": 3e-3, "micro_batch_tokens": 96, "keep_versions": 100}
    return tiny_learner_args(store, *extra, updates=updates, batch_groups=B, **options)


def kill_at(store: Path, hold: str, tmp_path: Path, *extra: str, updates: int = UPDATES) -> None:
    """Run the learner (with `extra` arguments) with GAGPO_LEARNER_HOLD=<hold>:<file>;
    SIGKILL it once held."""
    held = tmp_path / "held"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GAGPO_LEARNER_HOLD": f"{hold}:{held}"}
    proc = subprocess.Popen(
        learner_cmd(*lineage_args(store, updates=updates), *extra),
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
    )
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
    done = run_learner(*lineage_args(store, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]


def assert_one_lineage(store: Store, updates: int = UPDATES) -> None:
    assert store.policies.latest() == updates
    assert store.policies.folders() == list(range(updates + 1))  # v0 from the "actors"
    assert check_lineage(store) == []
    metrics = read_metrics(store)
    assert metrics["update"].to_list() == list(range(1, updates + 1))
    assert metrics["version"].to_list() == list(range(1, updates + 1))
    ledger = pl.from_arrow(Ledger.load(store).table())
    assert ledger.height == updates * B and ledger[C.GROUP_ID].n_unique() == updates * B
    assert ledger.group_by("update").len().sort("update")["len"].to_list() == [B] * updates

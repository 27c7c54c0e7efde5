"""Compaction while everything else runs: actors committing, the learner training and
compacting after every update, SQL queries and recomputes reading, all on one store.

Nothing may be lost or doubled, and no reader may fail, whatever instant a compaction
commits (schemas/archive.py: the reader's sequence lock and its retry on vanished files).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

from gagpo.learner.feed import Ledger
from gagpo.pipeline.config import GagpoConfig
from gagpo.pipeline.recompute import recompute_store
from gagpo.pipeline.sql import query_store
from gagpo.schemas import columns as C
from gagpo.schemas.archive import read_manifest, read_steps_table, step_files
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.store import Store

GAGPO = str(Path(sys.executable).with_name("gagpo"))
UPDATES = 8

# Rows, distinct steps and distinct groups the views see; rows == steps means no double.
COUNTS = "SELECT count(*) AS n, count(DISTINCT traj_id || ':' || step) AS d, count(DISTINCT group_id) AS g FROM steps"


@pytest.mark.slow
def test_readers_never_fail_nor_double_count_while_the_learner_compacts(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    env = dict(os.environ, HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path))
    run = subprocess.Popen(
        [GAGPO, "run", "--store", str(store_dir), "--recipe", "tiny", "--no-warmstart",
         "--set", f"learner.updates={UPDATES}", "--set", "learner.compaction.every_updates=1",
         "--set", "run.eval_groups=0"],  # fmt: skip
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen: list[tuple[int, int, int]] = []
    recomputes: list[int] = []
    errors: list[str] = []
    stop = threading.Event()

    def query() -> None:
        while not stop.is_set():
            try:
                row = query_store(str(store_dir), COUNTS).to_pylist()[0]
                seen.append((row["n"], row["d"], row["g"]))
            except GagpoError as exc:
                if "does not exist" not in str(exc):  # before the first actor commits
                    errors.append(f"sql: {exc}")
            time.sleep(0.05)

    def recompute() -> None:
        while not stop.is_set():
            try:
                summary = recompute_store(str(store_dir), None, GagpoConfig())
                recomputes.append(summary.diagnostics.batch["steps"])
            except GagpoError as exc:
                if "no committed shard" not in str(exc):
                    errors.append(f"advantages: {exc}")
            time.sleep(0.1)

    readers = [threading.Thread(target=query), threading.Thread(target=recompute)]
    for thread in readers:
        thread.start()
    try:
        out, _ = run.communicate(timeout=600)
    finally:
        stop.set()
        for thread in readers:
            thread.join()
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out[-3000:]
    assert "compaction" in out  # the learner did compact, while the readers read
    assert errors == []
    assert len(seen) >= 5 and len(recomputes) >= 2
    assert all(n == d for n, d, _ in seen), "a step was counted twice"
    groups = [g for _, _, g in seen]
    assert groups == sorted(groups), "a group vanished from the views"

    store = Store(str(store_dir))
    manifest = read_manifest(store)
    assert manifest is not None and manifest.generation >= 2
    steps = read_steps_table(store, [C.GROUP_ID, C.TRAJ_ID, C.STEP])
    keys = pc.binary_join_element_wise(steps[C.TRAJ_ID], pc.cast(steps[C.STEP], "string"), ":")
    assert len(pc.unique(keys)) == steps.num_rows
    # every trained group is in the archive or the inbox, exactly once; the ledger too
    ledger = Ledger.load(store).table()
    trained = set(ledger.filter(pc.equal(ledger["status"], "trained"))[C.GROUP_ID].to_pylist())
    assert len(trained) == UPDATES  # tiny: one group per update
    assert trained <= set(steps[C.GROUP_ID].to_pylist())
    assert len(set(ledger[C.GROUP_ID].to_pylist())) == ledger.num_rows
    # the archive holds trained groups, and the inbox none the archive holds
    files = step_files(store)
    assert files.segments and manifest.groups >= 1
    assert not {r.shard_id for r in files.shards} & manifest.compacted

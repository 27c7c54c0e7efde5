"""Compaction while everything else runs: actors committing, the learner training and
compacting after every update, SQL queries and recomputes reading, all on one store.

Nothing may be lost or doubled, and no reader may fail, whatever instant a compaction
commits (storage/archive.py: the reader's sequence lock and its retry on vanished files).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

from gagpo.inspection.sql import query_store
from gagpo.learner.feed import Ledger
from gagpo.pipeline.config import GagpoConfig
from gagpo.pipeline.recompute import recompute_store
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.storage.archive import moved_by, read_manifest, read_steps_table, step_files
from gagpo.storage.store import Store

GAGPO = str(Path(sys.executable).with_name("gagpo"))
UPDATES = 8

# Rows, distinct steps and distinct groups the views see; rows == steps means no double.
COUNTS = "SELECT count(*) AS n, count(DISTINCT traj_id || ':' || step) AS d, count(DISTINCT group_id) AS g FROM steps"


def tiny_run(store_dir: Path, *settings: str) -> list[str]:
    """`gagpo run` of the tiny recipe without its warm start, each of `settings` a --set."""
    sets = [arg for setting in settings for arg in ("--set", setting)]
    return [GAGPO, "run", "--store", str(store_dir), "--recipe", "tiny", "--no-warmstart", *sets]


def scratch_env(tmp_path: Path) -> dict[str, str]:
    """HOME and TMPDIR in the test's own folder."""
    return dict(os.environ, HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path))


@pytest.mark.slow
def test_readers_never_fail_nor_double_count_while_the_learner_compacts(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    run = subprocess.Popen(
        tiny_run(
            store_dir,
            f"learner.updates={UPDATES}",
            "learner.compaction.every_updates=1",
            "run.eval_groups=0",
        ),
        env=scratch_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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
            except Exception as exc:
                errors.append(f"sql: {type(exc).__name__}: {exc}")
            time.sleep(0.05)

    def recompute() -> None:
        while not stop.is_set():
            try:
                summary = recompute_store(str(store_dir), None, GagpoConfig())
                recomputes.append(summary.diagnostics.batch["steps"])
            except GagpoError as exc:
                if "no committed shard" not in str(exc):
                    errors.append(f"advantages: {exc}")
            except Exception as exc:
                errors.append(f"advantages: {type(exc).__name__}: {exc}")
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
    assert re.search(r"\[learner\] compaction \d+: ", out)  # it compacted while they read
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
    assert not {r.shard_id for r in files.shards} & moved_by(store, manifest)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["compact-written", "compact-committed"])
def test_a_learner_killed_while_it_compacts_resumes_on_one_lineage(
    tmp_path: Path, phase: str
) -> None:
    """SIGKILL the learner while its background compaction is at `phase` (its second
    compaction), then --resume: one lineage, every group trained once, and the next
    compaction finishes what the killed one left (nothing unnamed left in the archive)."""
    from gagpo.schemas.layout import ARCHIVE, LEDGER_PARTS, SEGMENTS
    from tests.helpers.learner import run_learner, tiny_model_dir, write_shards
    from tests.helpers.lineage import UPDATES, B, assert_one_lineage, kill_at, lineage_args

    store_dir = tmp_path / "store"
    store = Store(str(store_dir))
    write_shards(store, UPDATES, groups=B)  # one shard consumed per update
    store.policies.publish_base(str(tiny_model_dir()))  # v0, as actors publish it

    compaction = ["--set", "compaction.every_updates=1"]
    kill_at(store_dir, f"{phase}:2", tmp_path, *compaction)
    before = read_manifest(store)
    done = run_learner(*lineage_args(store_dir, "--resume"), *compaction)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_one_lineage(store)
    after = read_manifest(store)
    assert after.generation > (before.generation if before else 0)
    named = {s.id for s in after.segments}
    for folder in (SEGMENTS, LEDGER_PARTS):
        ids = {p.stem for p in (store_dir / ARCHIVE / folder).glob("*.parquet")}
        assert ids <= named, f"{folder}: {ids - named} left by the killed compaction"
    steps = read_steps_table(store, [C.TRAJ_ID, C.STEP, C.GROUP_ID])
    assert len(set(steps[C.GROUP_ID].to_pylist())) == UPDATES * B
    assert (
        len(set(zip(steps[C.TRAJ_ID].to_pylist(), steps[C.STEP].to_pylist(), strict=True)))
        == steps.num_rows
    )


@pytest.mark.slow
def test_every_view_and_recompute_is_the_same_after_gagpo_compact(tmp_path: Path) -> None:
    """A store that actors and a learner wrote (the tiny recipe, learner compaction off):
    every SQL view returns the same rows after `gagpo compact --all`, and GAGPO recomputed
    on the segments equals the recompute on the shards, float for float
    (benchmarks/compaction_equality.py; RESULTS.md has the demo store's run)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from compaction_equality import compare
    finally:
        sys.path.pop(0)
    store_dir = tmp_path / "store"
    done = subprocess.run(
        tiny_run(
            store_dir,
            "learner.updates=4",
            "learner.compaction.every_updates=0",
            "learner.compaction.min_mib=0",
        ),
        env=scratch_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert read_manifest(Store(str(store_dir))) is None  # the learner did not compact
    lines: list[str] = []
    assert compare(str(store_dir), echo=lines.append) == [], "\n".join(lines)
    from gagpo.inspection.sql_views import VIEWS

    assert sum(" same" in line for line in lines) == len(VIEWS) + 1  # every view, the recompute

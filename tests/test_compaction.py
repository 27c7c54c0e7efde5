"""Compaction (storage/compaction.py, learner/compact.py): consumed shards leave the inbox
(shards/) for archive segments, and the one reader (storage/archive.py) returns every
group exactly once before, during and after, also after a compaction killed at any phase.
"""

from __future__ import annotations

import json
import os
import posixpath
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from gagpo.learner.compact import compact_store, consumed_shards
from gagpo.learner.config import CompactionSettings
from gagpo.learner.feed import Ledger
from gagpo.schemas import columns as C
from gagpo.schemas.layout import ADVANTAGES, ARCHIVE, LEDGER_PARTS, MANIFESTS, SEGMENTS
from gagpo.storage.archive import (
    archived_ledger,
    cleared_path,
    ledger_part_path,
    manifest_folder,
    manifest_path,
    moved_by,
    moved_json,
    moved_path,
    moved_shards,
    read_ledger,
    read_manifest,
    read_steps_table,
    segment_path,
    step_files,
    tail_ledger_path,
)
from gagpo.storage.compaction import SORT_KEYS, compact
from gagpo.storage.store import ShardRef, Store
from tests.helpers.steps import make_steps

FULL_KEYS = [(C.GROUP_ID, "ascending"), (C.TRAJ_ID, "ascending"), (C.STEP, "ascending")]

RUNS = ("ra", "rb", "rc")
_BIN = Path(sys.executable).parent / "gagpo"
GAGPO = [str(_BIN)] if _BIN.exists() else [sys.executable, "-m", "gagpo.workflows.cli"]


# --- building stores ------------------------------------------------------------------
def fill(store: Store, n: int, first: int = 0, group_size: int = 3) -> list[ShardRef]:
    """`n` shards over three runs, 1 or 2 groups each (shard ids s000, s001, …)."""
    refs = []
    for i in range(first, first + n):
        table = make_steps(
            run_id=RUNS[i % len(RUNS)],
            shard_id=f"s{i:03d}",
            groups=1 + i % 2,
            group_size=group_size,
        )
        refs.append(store.write_shard(table, group_size=group_size))
    return refs


def ledger_of(
    store: Store, refs: list[ShardRef], update: int | list[int], status: str = "trained"
) -> pa.Table:
    """Ledger rows for every group of `refs` (one update for all, or one per shard)."""
    updates = update if isinstance(update, list) else [update] * len(refs)
    rows = []
    for ref, u in zip(refs, updates, strict=True):
        groups = sorted(set(store.read_table(ref.path, [C.GROUP_ID])[C.GROUP_ID].to_pylist()))
        for g in groups:
            rows.append(
                {
                    C.RUN_ID: ref.run_id,
                    C.SHARD_ID: ref.shard_id,
                    C.GROUP_ID: g,
                    C.SHARD_GROUPS: len(groups),
                    C.POLICY_VERSION: 0,
                    C.LEDGER_UPDATE: u,
                    C.LEDGER_LEARNER_VERSION: max(u - 1, 0),
                    C.LEDGER_STATUS: status,
                }
            )
    return pa.Table.from_pylist(rows, schema=C.LEDGER_SCHEMA)


def write_tail(store: Store, ledger: pa.Table) -> None:
    store.write_parquet(ledger, tail_ledger_path(store), {b"gagpo.test": b"kept"})


def write_fake_advantages(store: Store, tag: str, refs: list[ShardRef]) -> pa.Table:
    """A per-shard advantage table for each of `refs` (advantages/<tag>/<shard_id>.parquet);
    returns their union."""
    tables = []
    for ref in refs:
        steps = store.read_table(ref.path, [C.GROUP_ID, C.TRAJ_ID, C.STEP])
        table = steps.append_column(C.ADVANTAGE, pa.array([0.5] * steps.num_rows, pa.float64()))
        store.write_parquet(table, store.advantages_path(tag, ref.shard_id), {})
        tables.append(table)
    return pa.concat_tables(tables)


# --- checking -------------------------------------------------------------------------
def canon(table: pa.Table, keys=FULL_KEYS) -> pa.Table:
    """Rows sorted, metadata dropped: tables equal as sets of rows."""
    return table.sort_by(keys).replace_schema_metadata(None).combine_chunks()


def steps_canon(table: pa.Table) -> pa.Table:
    return canon(table.select(list(C.STEPS_COLUMNS)).cast(C.STEPS_SCHEMA))


def assert_each_group_once(store: Store, expected: pa.Table) -> None:
    """Every group of `expected` is in exactly one of the files step_files names, and
    read_steps_table returns `expected`'s rows, no more, no less."""
    files = step_files(store)
    owner: dict[str, str] = {}
    for path in files.paths(store):
        for g in set(store.read_table(path, [C.GROUP_ID])[C.GROUP_ID].to_pylist()):
            assert g not in owner, f"group {g} in {owner.get(g)} and in {path}"
            owner[g] = path
    assert set(owner) == set(expected[C.GROUP_ID].to_pylist())
    got = read_steps_table(store)
    assert got.num_rows == expected.num_rows
    assert steps_canon(got).equals(steps_canon(expected))


def names(store: Store, *parts: str) -> set[str]:
    """File names in a folder of the store, temporaries (dot files) included."""
    folder = store.path(*parts)
    store.fs.invalidate_cache()
    if not store.fs.exists(folder):
        return set()
    return {posixpath.basename(p.rstrip("/")) for p in store.fs.ls(folder, detail=False)}


def assert_tidy(store: Store, temporaries: bool = True) -> None:
    """No stray file: archive/segments and archive/ledger hold exactly what the newest
    manifest names, no shard it compacted is in the inbox, and every advantage table
    belongs to a live segment or an inbox shard (temporary files included unless
    `temporaries` is false)."""
    manifest = read_manifest(store)
    assert manifest is not None

    def listed(*parts: str) -> set[str]:
        return {n for n in names(store, *parts) if temporaries or not n.startswith(".")}

    named = {s.id for s in manifest.segments}
    assert listed(ARCHIVE, SEGMENTS) == {f"{i}.parquet" for i in named}
    with_ledger = {s.id for s in manifest.segments if s.min_update is not None}
    assert listed(ARCHIVE, LEDGER_PARTS) == {f"{i}.parquet" for i in with_ledger}
    for s in manifest.segments:
        assert store.exists(segment_path(store, s.id))
    inbox = {r.shard_id for r in store.list_shards()}
    assert not inbox & moved_by(store, manifest)
    for tag in names(store, ADVANTAGES):
        for name in listed(ADVANTAGES, tag):
            assert name.endswith(".parquet") and name[: -len(".parquet")] in named | inbox, (
                f"advantages/{tag}/{name}"
            )


def gagpo(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*GAGPO, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(w in lines[0] for w in words), lines[0]


# --- 1. each group moves exactly once ---------------------------------------------------
def test_compaction_moves_each_group_exactly_once(store_dir: Path):
    store = Store(str(store_dir))
    refs = fill(store, 8)
    before = read_steps_table(store)
    rows = {r.shard_id: store.read_table(r.path).num_rows for r in refs}
    assert before.num_rows == sum(rows.values())

    first = compact(store, refs[:5], None)
    assert (first.generation, first.shards, first.segments) == (1, 5, 1)
    assert first.groups == 7 and first.rows == sum(rows[r.shard_id] for r in refs[:5])
    manifest = read_manifest(store)
    assert manifest.generation == 1
    assert moved_by(store, manifest) == {r.shard_id for r in refs[:5]} and manifest.cleared
    (segment,) = manifest.segments
    assert segment.shards == 5 and segment.groups == 7 and segment.group_size == 3
    assert set(segment.runs) == set(RUNS) and not segment.consumed and segment.min_update is None
    assert [r.shard_id for r in store.list_shards()] == [r.shard_id for r in refs[5:]]
    assert not any(store.exists(r.path) for r in refs[:5])
    files = step_files(store)
    assert [s.id for s in files.segments] == [segment.id]
    assert [r.shard_id for r in files.shards] == [r.shard_id for r in refs[5:]]
    assert_each_group_once(store, before)
    assert_tidy(store)
    # the segment's groups are in id order, each in its shard's own row order
    seg = store.read_table(segment_path(store, segment.id))
    assert seg.equals(seg.sort_by(SORT_KEYS))
    ids = seg[C.GROUP_ID].to_pylist()
    assert ids == sorted(ids)
    for ref in refs[:5]:
        shard = before.filter(pc.equal(before[C.SHARD_ID], ref.shard_id))
        mine = seg.filter(pc.equal(seg[C.SHARD_ID], ref.shard_id))
        assert mine.select([C.TRAJ_ID, C.STEP]).equals(shard.select([C.TRAJ_ID, C.STEP]))
    # the run filter sees the segment's rows of that run, and the inbox's
    for run in RUNS:
        want = before.filter(pc.equal(before[C.RUN_ID], run))
        assert steps_canon(read_steps_table(store, run_id=run)).equals(steps_canon(want))

    # a second compaction grows the open segment: still one, the old file gone
    second = compact(store, refs[5:7], None)
    assert (second.generation, second.shards, second.segments) == (2, 2, 1)
    assert second.groups == 3  # the merged segment's own groups are not counted again
    manifest = read_manifest(store)
    assert manifest.generation == 2 and len(manifest.segments) == 1
    assert moved_by(store, manifest) == {r.shard_id for r in refs[5:7]} and manifest.cleared
    assert manifest.segments[0].id != segment.id and manifest.segments[0].shards == 7
    assert not store.exists(segment_path(store, segment.id))
    assert [r.shard_id for r in store.list_shards()] == [refs[7].shard_id]
    assert_each_group_once(store, before)
    assert_tidy(store)

    # nothing to move: no new generation
    assert compact(store, [], None).generation is None
    assert read_manifest(store).generation == 2


def test_tiny_segment_bytes_makes_several_segments(tmp_path: Path):
    store = Store(str(tmp_path / "a"))
    refs = fill(store, 6)
    before = read_steps_table(store)
    result = compact(store, refs, None, segment_bytes=1)  # every shard fills a segment
    manifest = read_manifest(store)
    assert result.segments == len(manifest.segments) == 6
    assert sorted(s.shards for s in manifest.segments) == [1] * 6
    assert store.list_shards() == []
    assert_each_group_once(store, before)
    assert_tidy(store)
    # a full segment is never reopened: the next compaction starts a new one
    more = fill(store, 2, first=6)
    before = read_steps_table(store)
    compact(store, more, None, segment_bytes=1)
    assert len(read_manifest(store).segments) == 8
    assert_each_group_once(store, before)

    # about two shards per segment: more than one segment, fewer than shards
    store = Store(str(tmp_path / "b"))
    refs = fill(store, 6)
    size = max(store.info(r.path)["size"] for r in refs)
    before = read_steps_table(store)
    compact(store, refs, None, segment_bytes=int(2.5 * size))
    segments = read_manifest(store).segments
    assert 1 < len(segments) < 6 and sum(s.shards for s in segments) == 6
    assert_each_group_once(store, before)
    assert_tidy(store)


def test_group_sizes_get_their_own_segments(store_dir: Path):
    store = Store(str(store_dir))
    threes = fill(store, 3)
    twos = fill(store, 2, first=10, group_size=2)
    before = read_steps_table(store)
    compact(store, threes + twos, None)
    segments = read_manifest(store).segments
    assert sorted((s.group_size, s.shards) for s in segments) == [(2, 2), (3, 3)]
    for s in segments:
        meta = store.read_table(segment_path(store, s.id)).schema.metadata
        assert meta[C.META_GROUP_SIZE] == str(s.group_size).encode()
    assert_each_group_once(store, before)


def test_a_bad_shard_is_quarantined_not_archived(store_dir: Path):
    store = Store(str(store_dir))
    refs = fill(store, 3)
    good = read_steps_table(store, groups={"s000-g0", "s002-g0"})
    store.fs.pipe_file(refs[1].path, b"PAR1 not parquet")
    result = compact(store, refs, None)
    assert result.shards == 2 and [p for p, _ in result.quarantined] == [refs[1].path]
    assert store.list_shards() == [] and moved_by(store, read_manifest(store)) == {"s000", "s002"}
    assert_each_group_once(store, good)


def put(store: Store, path: str, data: bytes) -> None:
    """A file put back where a compaction removed it (its emptied folder too)."""
    store.fs.makedirs(posixpath.dirname(path), exist_ok=True)
    store.fs.pipe_file(path, data)


def test_a_cleared_generation_is_read_without_its_moved_list(store_dir: Path):
    """A manifest read costs the segment list: once a generation is cleared, its moved list
    is never opened (here: gone, and every reader still answers); before, it is, and the
    moved shards still in the inbox are skipped."""
    store = Store(str(store_dir))
    refs = fill(store, 6)
    first = store.read_bytes(refs[0].path)
    compact(store, refs[:4], None)
    before = read_steps_table(store)
    manifest = read_manifest(store)
    assert manifest.cleared and manifest.moved_count == 4
    assert len(manifest.to_json()) < 1500  # segments only: no shard id in it
    sidecar = moved_path(store, manifest.moved_file)
    moved = moved_by(store, manifest)
    store.fs.rm_file(sidecar)
    assert [r.shard_id for r in step_files(store).shards] == [r.shard_id for r in refs[4:]]
    assert_each_group_once(store, before)
    # not cleared (a compaction killed between its commit and its marker), a moved shard
    # back in the inbox: the list is read, the shard skipped, the next compaction clears
    store.fs.pipe_file(sidecar, moved_json(sorted(moved)))
    store.fs.rm_file(cleared_path(store, manifest.generation))
    put(store, refs[0].path, first)  # its groups are in the segment
    assert not read_manifest(store).cleared
    assert refs[0].shard_id not in {r.shard_id for r in step_files(store).shards}
    assert_each_group_once(store, before)
    assert compact(store, [], None).recovered == 1
    assert read_manifest(store).cleared and not store.exists(refs[0].path)


def test_a_format_1_manifest_is_read_and_migrated(store_dir: Path):
    """Stores compacted before the moved list had its own file (format 1: the ids inline)
    read as before; the next compaction clears them and writes format 2."""
    store = Store(str(store_dir))
    refs = fill(store, 5)
    second = store.read_bytes(refs[1].path)
    compact(store, refs[:3], None)
    before = read_steps_table(store)
    manifest = read_manifest(store)
    old = json.loads(manifest.to_json())
    old |= {"format": 1, "compacted": sorted(moved_by(store, manifest))}
    del old["moved_file"], old["moved_count"]
    for path in store.glob(store.path(ARCHIVE, MANIFESTS, "*")):
        store.fs.rm_file(path)
    store.fs.pipe_file(manifest_path(store, 1), json.dumps(old).encode())
    put(store, refs[1].path, second)  # a moved shard left over
    migrated = read_manifest(store)
    assert migrated.inline_moved == {r.shard_id for r in refs[:3]} and not migrated.cleared
    assert refs[1].shard_id not in {r.shard_id for r in step_files(store).shards}
    assert_each_group_once(store, before)
    result = compact(store, store.list_shards(), None)  # removes refs[1], moves refs[3:]
    assert result.recovered == 1 and result.shards == 2
    newest = json.loads(store.read_bytes(manifest_path(store, 2)))
    assert newest["format"] == 2 and "compacted" not in newest
    assert_each_group_once(store, before)
    assert_tidy(store)


# --- 2. the ledger --------------------------------------------------------------------
def test_ledger_rows_are_archived_and_counted_once(store_dir: Path):
    store = Store(str(store_dir))
    refs = fill(store, 5)
    ledger = ledger_of(store, refs[:4], [1, 1, 2, 3])
    write_tail(store, ledger)  # the learner's tail holds the rows of every consumed group
    result = compact(store, refs[:3], ledger)
    manifest = read_manifest(store)
    (segment,) = manifest.segments
    moved = ledger.filter(
        pc.is_in(ledger[C.SHARD_ID], value_set=pa.array(["s000", "s001", "s002"]))
    )
    assert result.groups_archived == set(moved[C.GROUP_ID].to_pylist())
    assert segment.consumed and (segment.min_update, segment.max_update) == (1, 2)
    part = store.read_table(ledger_part_path(store, segment.id))
    keys = [(C.GROUP_ID, "ascending")]
    # the moved groups' rows, not s003's (consumed, still in the inbox)
    assert canon(part.cast(C.LEDGER_SCHEMA), keys).equals(canon(moved, keys))
    assert canon(archived_ledger(store), keys).equals(canon(moved, keys))

    # the tail still holds the archived rows: read_ledger counts each group once
    full = read_ledger(store)
    assert full.num_rows == ledger.num_rows == len(set(full[C.GROUP_ID].to_pylist()))
    assert canon(full, keys).equals(canon(ledger, keys))

    # the learner's view: archive plus tail, deduplicated; .tail_table() is the tail alone
    tail = store.read_table(tail_ledger_path(store))
    both = Ledger(tail, archived_ledger(store))  # would raise "consumed twice" otherwise
    assert len(both.rows) == ledger.num_rows
    assert set(both.tail_table()[C.GROUP_ID].to_pylist()) == {"s003-g0", "s003-g1"}
    assert set(both.archived_table()[C.GROUP_ID].to_pylist()) == result.groups_archived
    assert canon(both.table(), keys).equals(canon(ledger, keys))  # every row, once
    loaded = Ledger.load(store)
    assert set(loaded.tail_table()[C.GROUP_ID].to_pylist()) == {"s003-g0", "s003-g1"}
    assert canon(loaded.table(), keys).equals(canon(ledger, keys))
    # a learner that loaded the tail before the compaction: .archive() drops the rows
    mine = Ledger(tail)
    assert mine.tail_table().num_rows == ledger.num_rows
    mine.archive(result.groups_archived | {"not-a-recorded-group"})
    assert set(mine.tail_table()[C.GROUP_ID].to_pylist()) == {"s003-g0", "s003-g1"}
    assert set(mine.archived_table()[C.GROUP_ID].to_pylist()) == result.groups_archived
    assert mine.table().num_rows == ledger.num_rows
    assert "s000-g0" in mine and mine.shard_done("s001")
    mine.commit(store)  # what the learner writes at its next update: the tail alone
    assert set(store.read_table(tail_ledger_path(store))[C.GROUP_ID].to_pylist()) == {
        "s003-g0",
        "s003-g1",
    }
    assert canon(read_ledger(store), keys).equals(canon(ledger, keys))
    # a resume truncated before the archived rows' updates keeps them (archived = published)
    assert set(both.truncated(1).table()[C.GROUP_ID].to_pylist()) == result.groups_archived

    # merging into the open segment keeps its ledger part's rows, adds the new ones
    second = compact(store, [refs[3], refs[4]], ledger)
    (merged,) = read_manifest(store).segments
    assert second.groups_archived == {"s003-g0", "s003-g1"}
    assert not merged.consumed  # s004 has no ledger row
    assert (merged.min_update, merged.max_update) == (1, 3)
    assert not store.exists(ledger_part_path(store, segment.id))
    assert canon(archived_ledger(store), keys).equals(canon(ledger, keys))
    assert canon(read_ledger(store), keys).equals(canon(ledger, keys))
    assert_tidy(store)


def test_ledger_rows_of_other_groups_are_not_archived(store_dir: Path):
    """Only rows of the moved groups reach archive/ledger; a segment without any has no
    part, and read_ledger is then the tail alone."""
    store = Store(str(store_dir))
    refs = fill(store, 3)
    ledger = ledger_of(store, [refs[2]], 1)
    write_tail(store, ledger)
    compact(store, refs[:2], ledger)
    (segment,) = read_manifest(store).segments
    assert segment.min_update is None and not segment.consumed
    assert not store.exists(ledger_part_path(store, segment.id))
    assert archived_ledger(store).num_rows == 0
    assert read_ledger(store).equals(ledger)


# --- 3. which shards a compaction takes ---------------------------------------------------
def test_consumed_shards_picks_fully_consumed_shards_up_to_the_bound(store_dir: Path):
    store = Store(str(store_dir))
    refs = fill(store, 6)  # s000:1 group, s001:2, s002:1, s003:2, s004:1, s005:2
    by_id = {r.shard_id: r for r in refs}
    whole = ledger_of(store, refs, [1, 1, 2, 3, 1, 3])
    # s003: one group trained at update 1, the other at 3; s004: no row at all
    ledger = whole.filter(pc.not_equal(whole[C.SHARD_ID], "s004"))
    ledger = pa.Table.from_pylist(
        [
            r | ({C.LEDGER_UPDATE: 1} if r[C.GROUP_ID] == "s003-g0" else {})
            for r in ledger.to_pylist()
        ],
        schema=C.LEDGER_SCHEMA,
    )
    # s005: only one of its two groups consumed
    ledger = ledger.filter(pc.not_equal(ledger[C.GROUP_ID], "s005-g1"))

    def ids(bound):
        chosen, rows = consumed_shards(refs, ledger, bound)
        chosen_ids = [r.shard_id for r in chosen]
        assert all(by_id[s] is r for s, r in zip(chosen_ids, chosen, strict=True))
        assert set(rows[C.SHARD_ID].to_pylist()) == set(chosen_ids)  # their rows, only
        if bound is not None and rows.num_rows:
            assert pc.max(rows[C.LEDGER_UPDATE]).as_py() <= bound
        want = ledger.filter(
            pc.is_in(ledger[C.SHARD_ID], value_set=pa.array(chosen_ids, pa.string()))
        )
        if bound is not None:
            want = want.filter(pc.less_equal(want[C.LEDGER_UPDATE], bound))
        assert rows.num_rows == want.num_rows
        return chosen_ids

    assert ids(0) == []
    assert ids(1) == ["s000", "s001"]
    assert ids(2) == ["s000", "s001", "s002"]
    assert ids(3) == ["s000", "s001", "s002", "s003"]
    assert ids(None) == ["s000", "s001", "s002", "s003"]
    assert consumed_shards(refs, C.LEDGER_SCHEMA.empty_table(), None)[0] == []
    # a shard that is no longer in the inbox is never chosen
    assert [r.shard_id for r in consumed_shards(refs[1:], ledger, 3)[0]] == ["s001", "s002", "s003"]


# --- 4. a compaction killed at each phase ----------------------------------------------------
KILLED = """
import sys
from gagpo.storage.archive import read_ledger
from gagpo.storage.compaction import compact
from gagpo.storage.store import Store
store = Store(sys.argv[1])
compact(store, store.list_shards(), read_ledger(store))
"""


def _wait_for_pid(pidfile: Path, proc: subprocess.Popen, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pidfile.exists():
            text = pidfile.read_text().strip()
            if text:
                return int(text)
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before the hold point:\n{out}\n{err}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("the hold point was never reached")


def prepared_store(root: Path) -> tuple[Store, pa.Table]:
    """One archive generation (3 shards, with ledger rows and advantage tables) and 3
    inbox shards, one of them with ledger rows; returns the store and its ledger."""
    store = Store(str(root))
    refs = fill(store, 6)
    ledger = ledger_of(store, refs[:4], [1, 1, 2, 2])
    write_tail(store, ledger)
    store.policies.set_latest(2)  # the learner published updates 1 and 2
    write_fake_advantages(store, "fake", refs)
    compact(store, refs[:3], ledger)
    return store, ledger


def kill_at(tmp_path: Path, store: Store, phase: str, cli: bool) -> None:
    """Compact every inbox shard in a subprocess (`gagpo compact --all`, or compact()
    itself) held at `phase` (GAGPO_HOLD, storage/faults.py), then SIGKILL it there."""
    pidfile = tmp_path / "held.pid"
    command = (
        [*GAGPO, "compact", "--store", store.url, "--all"]
        if cli
        else [sys.executable, "-c", KILLED, store.url]
    )
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GAGPO_HOLD": f"{phase}:{pidfile}"},
    )
    try:
        pid = _wait_for_pid(pidfile, proc)
        assert pid == proc.pid
        os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL


def leftovers(store: Store) -> set[str]:
    """The files (temporaries aside) a killed compaction left for the next to remove:
    segments and ledger parts the newest manifest does not name, inbox shards it
    compacted, and the advantage tables of both."""
    manifest = read_manifest(store)
    named = {s.id for s in manifest.segments} if manifest else set()
    out, ids = set(), set()
    for folder in (SEGMENTS, LEDGER_PARTS):
        for name in names(store, ARCHIVE, folder):
            if not name.startswith(".") and name[: -len(".parquet")] not in named:
                out.add(store.path(ARCHIVE, folder, name))
                ids.add(name[: -len(".parquet")])
    for ref in store.list_shards():
        if ref.shard_id in moved_shards(store, manifest):
            out.add(ref.path)
            ids.add(ref.shard_id)
    folder = manifest_folder(store)
    keep = manifest.moved_file if manifest else None
    for generation, moved in folder.moved.items():  # moved lists no generation names
        if generation >= (manifest.generation if manifest else 0):
            out |= {store.path(ARCHIVE, MANIFESTS, n) for n in moved if n != keep}
    for tag in names(store, ADVANTAGES):
        for name in names(store, ADVANTAGES, tag):
            if not name.startswith(".") and name[: -len(".parquet")] in ids:
                out.add(store.path(ADVANTAGES, tag, name))
    return out


def temporaries(store: Store) -> list[str]:
    """Temporary files under archive/ and advantages/ (a killed commit's)."""
    found = []
    for parts in [(ARCHIVE, SEGMENTS), (ARCHIVE, LEDGER_PARTS), (ARCHIVE, MANIFESTS)] + [
        (ADVANTAGES, tag) for tag in names(store, ADVANTAGES)
    ]:
        found += [posixpath.join(*parts, n) for n in names(store, *parts) if n.startswith(".")]
    return found


KILL_PHASES = [
    # phase:n, what is committed there, the files it leaves (temporaries aside), the
    # generation committed, the inbox shards left
    pytest.param("commit-archive:1", 0, 1, 3, id="segment-commit"),  # the merged segment's
    pytest.param("commit-archive:2", 1, 1, 3, id="ledger-part-commit"),  # segment committed
    pytest.param("commit-advantages:1", 2, 1, 3, id="advantages-commit"),  # + ledger part
    pytest.param("compact-written:1", 3, 1, 3, id="written"),  # + its advantage table
    pytest.param("commit-archive:3", 3, 1, 3, id="moved-list-commit"),  # the moved list's
    # generation 2 committed: 3 moved shards and their tables, the merged segment, its
    # ledger part and table still there
    pytest.param("compact-committed:1", 9, 2, 3, id="committed"),
    # the moved shards and all their tables removed, the cleared marker not yet committed:
    # the merged segment and its ledger part left
    pytest.param("commit-archive:4", 2, 2, 0, id="cleared-commit"),
]


@pytest.mark.parametrize(("phase", "left", "generation", "inbox"), KILL_PHASES)
def test_a_killed_compaction_loses_nothing_and_is_finished_by_the_next(
    tmp_path, phase, left, generation, inbox
):
    store, ledger = prepared_store(tmp_path / "store")
    before = read_steps_table(store)
    cli = phase.startswith("compact-committed")
    kill_at(tmp_path, store, phase, cli=cli)  # the CLI once: its lease dies with it
    manifest = read_manifest(store)
    assert manifest.generation == generation
    assert manifest.cleared == (generation == 1)  # the prepared generation is cleared
    # readers: every group exactly once, the same rows, and the ledger once per group
    assert_each_group_once(store, before)
    keys = [(C.GROUP_ID, "ascending")]
    assert canon(read_ledger(store), keys).equals(canon(ledger, keys))
    assert len(store.list_shards()) == inbox
    if generation == 2:  # moved shards still in the inbox are skipped by readers
        assert not step_files(store).shards
    left_behind = leftovers(store)
    assert len(left_behind) == left, sorted(left_behind)

    # the next compaction (gagpo compact --all, taking the dead process's lease) finishes it
    lines: list[str] = []
    result = compact_store(store.url, None, True, CompactionSettings(), echo=lines.append)
    assert result.recovered >= left and not any(store.exists(p) for p in left_behind)
    if left:
        assert "a killed compaction left" in lines[-1], lines
    manifest = read_manifest(store)
    assert manifest.generation == 2
    assert store.list_shards() == []
    assert len(manifest.segments) == 1 and manifest.segments[0].shards == 6
    assert_each_group_once(store, before)
    assert canon(read_ledger(store), keys).equals(canon(ledger, keys))
    assert canon(archived_ledger(store), keys).equals(canon(ledger, keys))
    assert_tidy(store, temporaries=False)
    (segment,) = manifest.segments
    assert {n for n in names(store, ADVANTAGES, "fake") if not n.startswith(".")} == {
        f"{segment.id}.parquet"
    }
    # and a further compaction has nothing left to clean up
    again = compact(store, store.list_shards(), None)
    assert again.generation is None and again.recovered == 0


@pytest.mark.parametrize(
    "phase", ["commit-archive:1", "commit-archive:2", "commit-advantages:1", "commit-archive:3"]
)
def test_a_compaction_killed_inside_a_commit_leaves_no_temporary(tmp_path, phase):
    store, _ = prepared_store(tmp_path / "store")
    kill_at(tmp_path, store, phase, cli=False)
    assert temporaries(store)  # the killed commit's temporary file (the scenario)
    compact(store, store.list_shards(), read_ledger(store))
    assert temporaries(store) == []


class Killed(BaseException):
    pass


def _raise_at(phase: str, n: int):
    seen = {"n": 0}

    def point(name: str) -> None:
        if name == phase:
            seen["n"] += 1
            if seen["n"] == n:
                raise Killed(name)

    return point


@pytest.mark.parametrize(
    ("phase", "ledger_rows"),
    [
        pytest.param("commit-archive:1", True, id="segment-commit"),
        pytest.param("commit-archive:2", True, id="ledger-part-commit"),
        pytest.param("commit-advantages:1", True, id="advantages-commit"),
        pytest.param("compact-written:1", True, id="written"),
        pytest.param("commit-archive:3", True, id="moved-list-commit"),
        pytest.param("compact-committed:1", True, id="committed"),
        pytest.param("compact-committed:1", False, id="committed-without-ledger"),
        pytest.param("commit-archive:4", True, id="cleared-commit"),
    ],
)
def test_recovery_reports_exactly_the_files_it_removed(tmp_path, monkeypatch, phase, ledger_rows):
    """A compaction stopped at `phase` (in this process: an exception where the kill would
    be), then the next: `recovered` is the number of files that were left and are gone."""
    import gagpo.storage.compaction as compaction
    import gagpo.storage.store as store_module

    store = Store(str(tmp_path / "store"))
    refs = fill(store, 4)
    ledger = ledger_of(store, refs, 1) if ledger_rows else None
    write_fake_advantages(store, "fake", refs)
    compact(store, refs[:2], ledger)
    name, n = phase.split(":")
    point = _raise_at(name, int(n))
    monkeypatch.setattr(compaction, "fault_point", point)
    monkeypatch.setattr(store_module, "fault_point", point)
    with pytest.raises(Killed):
        compact(store, refs[2:], ledger)
    monkeypatch.undo()
    left = leftovers(store)
    assert left or phase == "commit-archive:1"
    result = compact(store, store.list_shards(), ledger)
    assert not any(store.exists(p) for p in left)
    assert result.recovered == len(left), sorted(left)
    assert_tidy(store)


# --- 5. the CLI -----------------------------------------------------------------------
def test_cli_default_moves_nothing_without_a_ledger_and_all_moves_everything(store_dir: Path):
    store = Store(str(store_dir))
    fill(store, 4)
    before = read_steps_table(store)
    done = gagpo("compact", "--store", str(store_dir))
    assert done.returncode == 0, done.stderr
    assert "compacting 0 shard(s)" in done.stdout and "nothing to move" in done.stdout
    assert len(store.list_shards()) == 4 and read_manifest(store) is None

    done = gagpo("compact", "--store", str(store_dir), "--all")
    assert done.returncode == 0, done.stderr
    assert "compacting 4 shard(s)" in done.stdout and "compaction 1: 4 shard(s)" in done.stdout
    assert store.list_shards() == [] and read_manifest(store).generation == 1
    assert_each_group_once(store, before)
    assert_tidy(store)


def test_cli_missing_store_is_one_line(tmp_path: Path):
    done = gagpo("compact", "--store", str(tmp_path / "nowhere"))
    assert_one_line_error(done, "does not exist")
    assert not (tmp_path / "nowhere").exists()


def test_compact_store_moves_what_published_updates_consumed(store_dir: Path):
    store = Store(str(store_dir))
    refs = fill(store, 5)
    ledger = ledger_of(store, refs[:4], [1, 1, 2, 3])  # updates 1, 2 published; 3 not
    write_tail(store, ledger)
    store.policies.set_latest(2)  # no lineage record: LATEST's version is its update
    before = read_steps_table(store)
    lines: list[str] = []
    result = compact_store(str(store_dir), None, False, CompactionSettings(), echo=lines.append)
    assert result.shards == 3 and lines[0].startswith("compacting 3 shard(s)"), lines
    assert [r.shard_id for r in store.list_shards()] == ["s003", "s004"]
    (segment,) = read_manifest(store).segments
    assert segment.consumed and (segment.min_update, segment.max_update) == (1, 2)
    # the archived rows left the tail (its metadata kept); the ledger still has every row once
    tail = store.read_table(tail_ledger_path(store))
    assert set(tail[C.SHARD_ID].to_pylist()) == {"s003"}
    assert tail.schema.metadata[b"gagpo.test"] == b"kept"
    keys = [(C.GROUP_ID, "ascending")]
    assert canon(read_ledger(store), keys).equals(canon(ledger, keys))
    assert_each_group_once(store, before)
    assert_tidy(store)


def test_compact_store_moves_nothing_when_only_v0_is_published(store_dir: Path):
    """A learner killed after committing update 1's ledger, before publishing v1: update 1
    is not published, so neither its shards nor its rows may reach the archive (a --resume
    from v0 trains those groups again)."""
    store = Store(str(store_dir))
    refs = fill(store, 2)
    write_tail(store, ledger_of(store, refs, 1))
    store.policies.set_latest(0)
    compact_store(str(store_dir), None, False, CompactionSettings(), echo=lambda _: None)
    assert len(store.list_shards()) == 2
    compact_store(str(store_dir), None, True, CompactionSettings(), echo=lambda _: None)
    assert store.list_shards() == [] and archived_ledger(store).num_rows == 0


HOLD_LEASE = """
import sys, time
from gagpo.learner.lease import acquire
from gagpo.storage.store import Store
acquire(Store(sys.argv[1]))
open(sys.argv[2], "w").write("held")
time.sleep(120)
"""


def test_cli_refuses_while_a_live_learner_holds_the_lease(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    fill(store, 2)
    env = {"GAGPO_LEASE_TTL_S": "1.5"}  # renewals every 0.25 s: refused within a beat
    flag = tmp_path / "held"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LEASE, store.url, str(flag)], env={**os.environ, **env}
    )
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        done = gagpo("compact", "--store", store.url, "--all", env=env)
        assert_one_line_error(done, "leased by the learner with pid", str(holder.pid))
        assert len(store.list_shards()) == 2 and read_manifest(store) is None
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (killed on this host): its lease is free at once
    result = compact_store(store.url, None, True, CompactionSettings(), echo=lambda _: None)
    assert result.shards == 2 and store.list_shards() == []


# --- 6. an object store ------------------------------------------------------------------
def test_compact_all_on_s3(s3_endpoint, tmp_path):
    url = f"s3://gagpo/{tmp_path.name}"
    store = Store(url, skip_instance_cache=True)
    refs = fill(store, 5)
    ledger = ledger_of(store, refs[:2], 1)
    write_tail(store, ledger)
    store.policies.set_latest(1)  # the learner published update 1
    write_fake_advantages(store, "fake", refs)
    before = read_steps_table(store)
    lines: list[str] = []
    result = compact_store(url, None, True, CompactionSettings(), echo=lines.append)
    assert result.generation == 1 and result.shards == 5, lines
    store = Store(url, skip_instance_cache=True)
    assert store.list_shards() == []
    assert_each_group_once(store, before)
    keys = [(C.GROUP_ID, "ascending")]
    assert canon(read_ledger(store), keys).equals(canon(ledger, keys))
    assert store.read_table(tail_ledger_path(store)).num_rows == 0  # all archived
    assert_tidy(store)
    (segment,) = read_manifest(store).segments
    assert names(store, ADVANTAGES, "fake") == {f"{segment.id}.parquet"}
    # more shards: merged into the open segment
    fill(store, 2, first=5)
    before = read_steps_table(store)
    assert compact_store(url, None, True, CompactionSettings(), echo=lines.append).shards == 2
    store = Store(url, skip_instance_cache=True)
    assert store.list_shards() == [] and len(read_manifest(store).segments) == 1
    assert_each_group_once(store, before)
    assert_tidy(store)


# --- 7. advantage tables --------------------------------------------------------------------
def test_advantage_tables_follow_their_groups_into_segments(store_dir: Path):
    from gagpo.pipeline.config import GagpoConfig
    from gagpo.pipeline.recompute import recompute_store

    store = Store(str(store_dir))
    refs = fill(store, 6)
    config = GagpoConfig()
    summary = recompute_store(store.url, None, config)
    assert summary.shards == 6
    folder = (ADVANTAGES, config.tag)
    assert names(store, *folder) == {f"{r.shard_id}.parquet" for r in refs}
    per_shard = {
        r.shard_id: store.read_table(store.advantages_path(config.tag, r.shard_id)) for r in refs
    }
    keys = SORT_KEYS

    # a tag with tables for only some shards: the segment's table holds just those
    partial = write_fake_advantages(store, "partial", refs[1:3])

    compact(store, refs[:4], None, segment_bytes=2 * max(store.info(r.path)["size"] for r in refs))
    segments = read_manifest(store).segments
    assert len(segments) >= 2
    inbox = {r.shard_id for r in refs[4:]}
    assert names(store, *folder) == {f"{s.id}.parquet" for s in segments} | {
        f"{i}.parquet" for i in inbox
    }
    union = pa.concat_tables([per_shard[r.shard_id] for r in refs[:4]])
    tables = [store.read_table(store.advantages_path(config.tag, s.id)) for s in segments]
    for s, t in zip(segments, tables, strict=True):  # one table per segment, its groups'
        groups = set(
            store.read_table(segment_path(store, s.id), [C.GROUP_ID])[C.GROUP_ID].to_pylist()
        )
        assert set(t[C.GROUP_ID].to_pylist()) == groups
        assert t.equals(t.sort_by(keys))
        assert t.schema.metadata == per_shard["s000"].schema.metadata  # the estimator's record
    assert canon(pa.concat_tables(tables), keys).equals(canon(union, keys))
    got = pa.concat_tables(
        [
            store.read_table(store.advantages_path("partial", s.id))
            for s in segments
            if store.exists(store.advantages_path("partial", s.id))
        ]
    )
    assert canon(got, keys).equals(canon(partial, keys))

    # a second compaction merges the open segment's table with the new shards' tables
    compact(store, refs[4:], None)
    segments = read_manifest(store).segments
    assert names(store, *folder) == {f"{s.id}.parquet" for s in segments}
    union = pa.concat_tables(list(per_shard.values()))
    tables = [store.read_table(store.advantages_path(config.tag, s.id)) for s in segments]
    assert canon(pa.concat_tables(tables), keys).equals(canon(union, keys))
    assert_tidy(store)


def test_gagpo_advantages_store_tables_then_compact(store_dir: Path):
    """The same with the tables of `gagpo advantages --store`, then compact --all."""
    store = Store(str(store_dir))
    refs = fill(store, 3)
    done = gagpo("advantages", "--store", str(store_dir))
    assert done.returncode == 0, done.stderr
    (tag,) = names(store, ADVANTAGES)
    per_shard = [store.read_table(store.advantages_path(tag, r.shard_id)) for r in refs]
    compact_store(str(store_dir), None, True, CompactionSettings(), echo=lambda _: None)
    (segment,) = read_manifest(store).segments
    assert names(store, ADVANTAGES, tag) == {f"{segment.id}.parquet"}
    keys = [(C.GROUP_ID, "ascending"), (C.TRAJ_ID, "ascending"), (C.STEP, "ascending")]
    got = store.read_table(store.advantages_path(tag, segment.id))
    assert canon(got, keys).equals(canon(pa.concat_tables(per_shard), keys))

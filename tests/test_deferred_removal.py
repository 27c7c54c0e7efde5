"""Deferred removal (issue 46): a compaction with `defer_removal` keeps what its generation
superseded (the inbox shards it moved, the segment it merged, their advantage tables and
ledger parts) until the next generation commits, so a reader whose pass spans one whole
compaction finds every file it resolved and needs no second pass
(storage/compaction.py, docs/design.md §7).

Also: the moved shards left in the inbox are read by no reader and moved by no compaction
again, and a compaction cut at any store operation (an exception raised there, as a kill
leaves the store) leaves the readers exact and the next compactions tidy.
"""

from __future__ import annotations

import shutil

import pyarrow.compute as pc
import pytest

from gagpo.inspection import sql_sources as src
from gagpo.inspection.sql import query_store
from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.storage.archive import (
    advantage_tags,
    moved_by,
    previous_manifest,
    read_manifest,
    read_steps_table,
    step_files,
)
from gagpo.storage.compaction import compact
from gagpo.storage.store import Store
from tests.helpers.compacting import commit_shard, prepared

COUNTS = (
    "SELECT (SELECT count(*) FROM steps) AS n,"
    " (SELECT count(DISTINCT traj_id || ':' || step) FROM steps) AS d,"
    " (SELECT list(DISTINCT group_id) FROM steps) AS ids,"
    " (SELECT count(*) FROM advantages) AS a"
)


def files_of(store: Store) -> list[str]:
    """Every file a resolution names: steps files and their advantage tables."""
    files = step_files(store)
    tables = [store.advantages_path(t, i) for t in advantage_tags(store) for i in files.ids()]
    return files.paths(store) + [p for p in tables if store.exists(p)]


def query_with_a_compaction_inside(store: Store, monkeypatch, defer: bool):
    """Run COUNTS with one whole compaction (all shards but the newest, merging the open
    segment) between the reader's resolution and the rest of its pass; the reader's passes,
    the compactions run, and the answer."""
    passes = {"n": 0, "compactions": 0}
    resolve, one_pass = src.step_files, src._sources_pass

    def resolve_then_compact(*args, **kwargs):
        files = resolve(*args, **kwargs)
        if passes["compactions"] == 0:
            passes["compactions"] += 1
            result = compact(store, store.list_shards()[:-1], None, defer_removal=defer)
            assert result.shards == 2 and result.generation == 2, result
        return files

    def counted(*args, **kwargs):
        passes["n"] += 1
        return one_pass(*args, **kwargs)

    monkeypatch.setattr(src, "step_files", resolve_then_compact)
    monkeypatch.setattr(src, "_sources_pass", counted)
    return passes, query_store(str(store.root), COUNTS).to_pylist()[0]


def test_a_reader_pass_spanning_one_whole_compaction_finds_every_file(tmp_path, monkeypatch):
    """The pass resolves the store, then a whole compaction runs (it merges the open segment
    and moves two shards), then the pass reads its footers and lists the advantage tables:
    one pass, nothing missing, each group and step once. Before (removal at once) the moved
    shards and the merged segment were gone: the pass was thrown away and resolved again."""
    store, expected = prepared(str(tmp_path / "store"), defer=True)
    groups, steps = expected.groups, expected.steps
    named = files_of(store)
    passes, answer = query_with_a_compaction_inside(store, monkeypatch, defer=True)
    assert passes == {"n": 1, "compactions": 1}, passes
    assert [p for p in named if not store.exists(p)] == []
    assert set(answer["ids"]) == groups and answer["n"] == answer["d"] == steps, answer
    assert answer["a"] == steps, answer  # one advantage row a step


def test_removal_at_once_still_costs_a_second_pass(tmp_path, monkeypatch):
    """The contrast (and the default, `gagpo compact`'s): a compaction that removes at once
    takes files from under the pass; the reader notices and resolves again, exact."""
    store, expected = prepared(str(tmp_path / "store"))
    groups, steps = expected.groups, expected.steps
    passes, answer = query_with_a_compaction_inside(store, monkeypatch, defer=False)
    assert passes["n"] == 2, passes
    assert set(answer["ids"]) == groups and answer["n"] == answer["d"] == steps == answer["a"]


def test_what_a_generation_superseded_goes_when_the_next_one_commits(tmp_path):
    """Generation 2 moves two shards and merges the open segment: all stay (readers skip
    the moved shards by generation 2's moved list), and no compaction moves them again,
    while generation 1's leftovers went at generation 2's commit; generation 3's commit
    removes generation 2's, which is then cleared."""
    store, expected = prepared(str(tmp_path / "store"), defer=True)
    groups = expected.groups
    first = read_manifest(store)
    assert first.defers and not first.cleared and moved_by(store, first)
    compact(store, store.list_shards()[:-1], None, defer_removal=True)
    second = read_manifest(store)
    assert second.defers and not second.cleared and second.previous_cleared
    moved = moved_by(store, second)
    inbox = {r.shard_id for r in store.list_shards()}
    assert moved <= inbox  # nothing of its own removed yet; generation 1's, at its commit
    assert not inbox & moved_by(store, first)
    merged = {s.id for s in first.segments} - {s.id for s in second.segments}
    assert merged and all(store.exists(layout.segment(store.root, i)) for i in merged)
    assert {r.shard_id for r in step_files(store).shards}.isdisjoint(moved)
    # a compaction handed only shards already moved moves nothing
    again = compact(store, [r for r in store.list_shards() if r.shard_id in moved], None)
    assert again.generation is None and read_manifest(store).generation == 2
    assert moved <= {r.shard_id for r in store.list_shards()}  # not removed: no commit
    groups |= commit_shard(store, 50)
    compact(store, store.list_shards(), None, defer_removal=True)
    third = read_manifest(store)
    assert previous_manifest(store, third).cleared and not third.cleared
    inbox = {r.shard_id for r in store.list_shards()}
    assert not inbox & moved and inbox <= moved_by(store, third)
    assert not any(store.exists(layout.segment(store.root, i)) for i in merged)
    table = read_steps_table(store, [C.GROUP_ID, C.TRAJ_ID, C.STEP])
    assert set(table[C.GROUP_ID].to_pylist()) == groups
    keys = pc.binary_join_element_wise(table[C.TRAJ_ID], pc.cast(table[C.STEP], "string"), ":")
    assert len(pc.unique(keys)) == table.num_rows  # each step once
    # a compaction that removes at once clears both generations' leftovers
    groups |= commit_shard(store, 51)
    compact(store, store.list_shards(), None)
    assert_tidy(store)
    assert set(read_steps_table(store, [C.GROUP_ID])[C.GROUP_ID].to_pylist()) == groups


def assert_tidy(store: Store) -> None:
    """Only what the newest manifest names is left (it removes at once, and is cleared)."""
    manifest = read_manifest(store)
    assert manifest.cleared and manifest.previous_cleared
    named = {s.id for s in manifest.segments}
    on_disk = {layout.file_id(p) for p in store.glob(layout.segment(store.root, "*"))}
    assert on_disk == named
    inbox = {r.shard_id for r in store.list_shards()}
    assert not inbox & moved_by(store, manifest)
    tables = store.glob(layout.advantages(store.root, "*", "*"))
    assert {layout.file_id(p) for p in tables} <= named | inbox


class Cut(Exception):
    """A compaction stopped at one store operation (what a kill there leaves)."""


OPERATIONS = ("commit_bytes", "create_exclusive", "remove_files", "write_parquet")


def cut_at(monkeypatch, at: int) -> dict:
    """Raise Cut at the `at`-th store operation (writes and removals) from now on."""
    seen = {"n": 0, "armed": True}
    for name in OPERATIONS:
        original = getattr(Store, name)

        def wrapper(self, *args, _original=original, **kwargs):
            if seen["armed"]:
                seen["n"] += 1
                if seen["n"] == at:
                    seen["armed"] = False
                    raise Cut(f"operation {at}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Store, name, wrapper)
    return seen


@pytest.mark.parametrize("defer_next", [True, False])
def test_a_compaction_cut_at_any_operation_leaves_readers_exact_and_recovery_tidy(
    tmp_path, monkeypatch, defer_next
):
    """Generation 2 defers; generation 3 (deferring, or removing at once) is cut at each of
    its store operations in turn: the readers see every group once right after, and the
    next two compactions (a deferring one, then one that removes at once) leave only what
    the newest manifest names."""
    template, expected = prepared(str(tmp_path / "template"), defer=True)
    groups = expected.groups
    compact(template, template.list_shards()[:-1], None, defer_removal=True)
    groups |= commit_shard(template, 60) | commit_shard(template, 61)
    points, cut = 0, True
    while cut:
        points += 1
        url = str(tmp_path / f"s{points}")
        shutil.copytree(template.root, url)
        store = Store(url)
        seen = cut_at(monkeypatch, points)
        try:
            compact(store, store.list_shards()[:-1], None, defer_removal=defer_next)
            cut = False  # ran past its last operation: every point was cut
        except Cut:
            pass
        seen["armed"] = False
        monkeypatch.undo()
        where = f"cut at operation {points}"
        table = read_steps_table(store, [C.GROUP_ID, C.TRAJ_ID, C.STEP])
        assert set(table[C.GROUP_ID].to_pylist()) == groups, where
        keys = pc.binary_join_element_wise(table[C.TRAJ_ID], pc.cast(table[C.STEP], "string"), ":")
        assert len(pc.unique(keys)) == table.num_rows, where
        answer = query_store(url, COUNTS).to_pylist()[0]
        assert set(answer["ids"]) == groups and answer["n"] == answer["d"], where
        both = groups | commit_shard(store, 70)
        compact(store, store.list_shards(), None, defer_removal=True)
        both |= commit_shard(store, 71)
        compact(store, store.list_shards(), None)
        assert_tidy(store)
        assert set(read_steps_table(store, [C.GROUP_ID])[C.GROUP_ID].to_pylist()) == both, where
    assert points >= 8, points

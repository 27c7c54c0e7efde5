"""A small store with an archive and an inbox, for the tests of readers during compactions
(tests/test_reliability_round6_compaction.py, tests/test_deferred_removal.py)."""

from __future__ import annotations

from dataclasses import dataclass

from gagpo.pipeline.config import GagpoConfig
from gagpo.pipeline.recompute import recompute_store
from gagpo.schemas import columns as C
from gagpo.storage.archive import read_steps_table
from gagpo.storage.compaction import compact
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps

GROUP_SIZE = 3


def commit_shard(store: Store, number: int, groups: int = 1) -> set[str]:
    """Commit shard `number` (1 or `groups` groups) as an actor does; its group ids."""
    table = make_steps(
        run_id=f"r{number % 2}", shard_id=f"s{number:04d}", groups=groups, group_size=GROUP_SIZE
    )
    store.write_shard(table, group_size=GROUP_SIZE)
    return set(table[C.GROUP_ID].to_pylist())


@dataclass
class Expected:
    groups: set[str]
    steps: int
    advantages: int  # steps with an advantage table


def prepared(url: str, defer: bool = False) -> tuple[Store, Expected]:
    """A store with an archive (one open segment) and an inbox of three shards, each file
    with its advantage table: the next compaction merges the segment and moves two.
    `defer`: the archive's generation defers removal (its moved shards still there)."""
    store = Store(url)
    groups: set[str] = set()
    for number in range(6):
        groups |= commit_shard(store, number, groups=1 + number % 2)
    recompute_store(url, None, GagpoConfig())
    compact(store, store.list_shards()[:3], None, defer_removal=defer)
    steps = read_steps_table(store, [C.GROUP_ID]).num_rows
    return store, Expected(groups, steps, steps)

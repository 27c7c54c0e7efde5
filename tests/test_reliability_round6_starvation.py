"""Issue 46 (reliability round 6): a SQL reader slower than back-to-back compactions still gets
through, with every group once.

Here the compactor commits after every `EVERY`-th footer the reader reads from the store (an
actor commits a shard and a compaction moves the oldest one, merging the open segment):
the compactor never rests, as measured in the reader's own work. A pass that rereads every
footer is interrupted on every attempt, so the reader of the first fix gave up after its 20
(`compactions kept removing files`). inspection/sql_sources.py `step_sources` now rereads
only the footers no earlier pass read: a pass after a compaction costs what it wrote.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from gagpo.inspection import sql_sources as src
from gagpo.inspection.sql import query_store
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.storage import resolving
from gagpo.storage.compaction import compact
from gagpo.storage.resolving import RESOLVE_ATTEMPTS
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps

GROUP_SIZE = 3
INBOX = 24  # shards in the inbox: a full pass reads their footers
EVERY = 8  # footers the reader reads between two compactions

COUNTS = (
    "SELECT count(*) AS n, count(DISTINCT traj_id || ':' || step) AS d,"
    " list(DISTINCT group_id) AS ids FROM steps"
)


def commit(store: Store, number: int) -> set[str]:
    table = make_steps(run_id="r", shard_id=f"s{number:04d}", groups=1, group_size=GROUP_SIZE)
    store.write_shard(table, group_size=GROUP_SIZE)
    return set(table[C.GROUP_ID].to_pylist())


def test_a_reader_slower_than_back_to_back_compactions_gets_every_group_once(tmp_path, monkeypatch):
    store = Store(str(tmp_path / "store"))
    committed: set[str] = set()
    for number in range(INBOX + 2):
        committed |= commit(store, number)
    compact(store, store.list_shards()[:2], None)  # an archive with an open segment

    state = {"reads": 0, "next": INBOX + 2, "compactions": 0, "active": True}
    read_schema = pq.read_schema

    def footer_then_maybe_compact(handle, *args, **kwargs):
        schema = read_schema(handle, *args, **kwargs)
        state["reads"] += 1
        if state["active"] and state["reads"] % EVERY == 0:
            committed.update(commit(store, state["next"]))
            state["next"] += 1
            compact(store, store.list_shards()[:1], None)
            state["compactions"] += 1
        return schema

    monkeypatch.setattr(src.pq, "read_schema", footer_then_maybe_compact)
    before = set(committed)
    answer = query_store(str(store.root), COUNTS).to_pylist()[0]
    state["active"] = False
    seen = set(answer["ids"])
    assert state["compactions"] >= 2, state  # the reader was interrupted, and got through
    assert answer["n"] == answer["d"], answer  # each step once
    assert before <= seen <= committed, (sorted(before - seen), sorted(seen - committed))


def test_a_reader_that_never_gets_a_quiet_pass_stops_in_one_line(tmp_path, monkeypatch):
    """The wait is bounded: when every pass is interrupted (a compaction at each footer read,
    new files every time), the reader stops after RESOLVE_ATTEMPTS passes and its deadline
    (here 0 s) with one line saying why."""
    store = Store(str(tmp_path / "store"))
    for number in range(4):
        commit(store, number)
    compact(store, store.list_shards()[:2], None)
    state = {"next": 4}
    read_schema = pq.read_schema

    def footer_then_compact(handle, *args, **kwargs):
        schema = read_schema(handle, *args, **kwargs)
        commit(store, state["next"])
        state["next"] += 1
        compact(store, store.list_shards()[:1], None)
        return schema

    monkeypatch.setattr(src.pq, "read_schema", footer_then_compact)
    monkeypatch.setattr(resolving, "RESOLVE_PAUSE_S", 0.0)  # Tries reads it there
    with pytest.raises(GagpoError) as stopped:
        src.step_sources(store, src.arrow_filesystem(store), deadline_s=0.0)
    text = str(stopped.value)
    assert "\n" not in text and "compactions kept removing files" in text, text
    assert f"({RESOLVE_ATTEMPTS} attempts in" in text, text

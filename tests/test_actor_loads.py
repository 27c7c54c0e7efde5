"""Issue 40: each policy version an actor loads is recorded in the store (policy/loads/,
storage/registry.py `LoadLog`) and read back by `gagpo sql`'s `policy_loads` view; the
version here is published as a delta of v0, which the actor applies in its cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gagpo.inspection.sql import close_store_db, open_store_db
from gagpo.learner.publish import put_folder
from gagpo.schemas import layout
from gagpo.storage.delta import DeltaPublisher
from gagpo.storage.registry import LOADS_SCHEMA, LoadLog
from gagpo.storage.store import Store
from tests.helpers.actors import actor_config
from tests.helpers.versions import perturbed_copy

SOKOBAN = {"sizes": [5, 5], "max_boxes": 1}


def _publish_delta_of_v0(store: Store, tmp: Path) -> Path:
    """v1 = v0's weights plus noise, published as a delta of v0; LATEST → 1. Returns the
    full v1 folder (the reference)."""
    v0, v1 = tmp / "v0", tmp / "v1"
    shutil.copytree(store.policies.dir(0), v0, ignore=shutil.ignore_patterns(".*"))
    perturbed_copy(v0, v1)
    (v1 / layout.COMPLETE).unlink()
    reference = tmp / "v1-full"
    shutil.copytree(v1, reference)
    publisher = DeltaPublisher(every=10)
    publisher.encode(v0, 0)  # v0 is full: held as the base of v1
    assert publisher.encode(v1, 1)
    put_folder(store, v1, store.policies.dir(1), phase="publish")
    store.policies.set_latest(1)
    return reference


def test_an_actor_records_each_version_it_loads_and_sql_reads_them(tmp_path: Path):
    from gagpo.actors.actor import run_actor

    store = Store(str(tmp_path / "store"))
    published: dict[str, Path] = {}

    def progress(summary) -> None:
        if summary.groups == 1 and not published:
            published["v1"] = _publish_delta_of_v0(store, tmp_path)

    # v1 is published as group 1 ends, applied in the background (a local store's delta
    # version), loaded at a later group's end: groups remain for it to play.
    config = actor_config(
        str(store.root), "sokoban", groups=5, group_size=2, max_turns=2, env_options=SOKOBAN
    )
    summary = run_actor(config, progress=progress)
    assert store.policies.is_delta(1)
    assert [load.version for load in summary.loads] == [1]
    assert 1 in summary.versions  # groups after the load were played by v1

    con = open_store_db(store)
    try:
        cursor = con.execute("SELECT * FROM policy_loads")
        names = [column[0] for column in cursor.description]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    finally:
        close_store_db(con)
    load = summary.loads[0]
    assert len(rows) == 1
    row = rows[0]
    assert (row["run_id"], row["version"]) == (summary.run_id, 1)
    assert row["fetch_s"] == load.fetch_s and row["load_s"] == load.load_s
    assert row["pause_s"] == pytest.approx(load.drain_s + load.load_s)
    assert row["loaded_at"] is not None
    # what the actor loaded is v1 whole, bit for bit, though the store holds a delta
    from gagpo.schemas.cache import policy_cache_dir
    from gagpo.storage.policy_cache import _safe_name

    cached = policy_cache_dir() / _safe_name(store.url) / "v1"
    for reference in published["v1"].glob("*.safetensors"):
        assert (cached / reference.name).read_bytes() == reference.read_bytes()


def test_two_actors_never_write_the_same_load_file(store_dir: Path):
    """Each LoadLog names a file of its own, rewritten whole with every load; the view
    reads every actor's rows."""
    store = Store(str(store_dir))
    first, second = LoadLog(store, "run-a"), LoadLog(store, "run-a")  # even one run id
    first.add(3, 1.5, 0.0, 2.0)
    second.add(3, 2.5, 0.1, 1.0)
    first.add(5, 1.0, 0.2, 0.5)
    assert first.path != second.path
    assert [store.read_table(p).num_rows for p in (first.path, second.path)] == [2, 1]
    assert store.read_table(first.path).schema.equals(LOADS_SCHEMA)
    con = open_store_db(store)
    try:
        got = con.execute(
            "SELECT version, pause_s FROM policy_loads ORDER BY version, pause_s"
        ).fetchall()
    finally:
        close_store_db(con)
    assert [version for version, _ in got] == [3, 3, 5]
    assert [pause for _, pause in got] == pytest.approx([1.1, 2.0, 0.7])  # drain + load

"""`gagpo sql` over a compacted store: DuckDB reads the archive's segments itself (allowed
by path), the inbox tail through Arrow. The views must answer exactly as the Arrow scan of
the same files does, and nothing may attach, copy over or export to a segment."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pytest

from gagpo.inspection import sql
from gagpo.inspection import sql_sources as src
from gagpo.inspection.sql_segments import segment_url
from gagpo.inspection.sql_views import VIEWS
from gagpo.schemas.errors import GagpoError
from gagpo.storage.archive import read_manifest, segment_path, step_files
from gagpo.storage.compaction import compact
from gagpo.storage.store import Store
from tests.helpers.sql import compacted_store


def every_view(store: Store) -> dict[str, tuple[list, list]]:
    """Per view: its (column, type) pairs and its rows in a fixed order."""
    con = sql.open_store_db(store)
    try:
        out = {}
        for view in VIEWS:
            columns = sql.view_columns(con, view)
            rows = con.execute(f"SELECT * FROM {view} ORDER BY ALL").fetchall()
            out[view] = (columns, rows)
        return out
    finally:
        sql.close_store_db(con)


def test_segments_are_read_by_duckdb_and_answer_as_the_arrow_scan(tmp_path, monkeypatch):
    store = compacted_store(tmp_path / "store")
    files = step_files(store)
    assert files.segments and files.shards  # archive and inbox both hold groups
    assert src.native_segments(store, files) == files.segment_paths(store)
    native = every_view(store)
    monkeypatch.setattr(src, "native_segments", lambda store, files: None)
    arrow = every_view(store)
    assert native.keys() == arrow.keys()
    for view in VIEWS:
        assert native[view][0] == arrow[view][0], view  # the same columns and types
        assert native[view][1] == arrow[view][1], view  # the same rows
    assert len(native["steps"][1]) == sum(store.read_table(p).num_rows for p in files.paths(store))


def test_a_store_path_duckdb_would_read_as_a_pattern_is_scanned_by_arrow(tmp_path):
    store = compacted_store(tmp_path / "runs[1]" / "store")
    files = step_files(store)
    assert files.segments and src.native_segments(store, files) is None
    n = sum(store.read_table(p).num_rows for p in files.paths(store))
    assert sql.query_store(store, "SELECT count(*) AS n FROM steps")["n"].to_pylist() == [n]


SEGMENT_WRITES = [
    "ATTACH '{segment}' AS d (READ_WRITE)",
    "ATTACH '{segment}' AS d; CREATE TABLE d.t AS SELECT 1",
    "DETACH d",
    "COPY (SELECT 1 AS x) TO '{segment}' (FORMAT parquet, USE_TMP_FILE false)",
    "COPY (SELECT * FROM steps) TO '{segment}' (FORMAT parquet)",
    "EXPORT DATABASE '{folder}'",
    "SELECT 1; COPY (SELECT 1) TO '{segment}'",
    "UPDATE EXTENSIONS",
    "SELECT * FROM read_parquet('{folder}/*.parquet')",  # the folder: no listing
    "SET allowed_paths = ['/']",
]


@pytest.mark.parametrize("template", SEGMENT_WRITES)
def test_an_allowed_segment_can_be_read_never_written(tmp_path, template):
    store = compacted_store(tmp_path / "store")
    (segment,) = read_manifest(store).segments
    path = segment_path(store, segment.id)
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    listing = sorted(p.name for p in Path(path).parent.iterdir())
    con = sql.open_store_db(store)
    try:
        query = template.format(segment=path, folder=str(Path(path).parent))
        with pytest.raises(GagpoError, match=r"^query refused: gagpo sql is read-only"):
            sql.run_query(con, query)
        # reading it (by its read-only URL) is reading the store's own rows, as steps does
        url = segment_url(path)
        direct = sql.run_query(con, f"SELECT count(*) AS n FROM read_parquet('{url}')")
        assert direct["n"].to_pylist() == [segment.rows]
    finally:
        sql.close_store_db(con)
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in Path(path).parent.iterdir()) == listing


def test_a_segment_merged_away_during_a_query_makes_it_run_again(tmp_path, monkeypatch):
    """A compaction merges the open segment into a new one while a query's connection
    names the old: DuckDB cannot open it, and query_store answers from the store as it
    stands (each group once)."""
    store = compacted_store(tmp_path / "store")
    want = sql.query_store(store, "SELECT count(*) AS n FROM steps")["n"].to_pylist()
    opened = sql.open_store_db
    calls = {"n": 0}

    def open_then_compact(*args, **kwargs):
        con = opened(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:  # the old segment is merged into a new one, the inbox moved
            compact(store, store.list_shards(), None)
        return con

    monkeypatch.setattr(sql, "open_store_db", open_then_compact)
    got = sql.query_store(store, "SELECT count(*) AS n FROM steps")
    assert calls["n"] == 2 and got["n"].to_pylist() == want
    assert isinstance(got, pa.Table)

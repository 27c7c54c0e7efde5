"""Issue 46 (reliability round 6): a SQL view over an object store's files fails, never hangs,
when files it names are gone.

The round's S3 stress runs stalled for minutes inside a DuckDB query: DuckDB opens a
registered Arrow dataset with `scanner(...).to_reader()`, which pyarrow runs holding the GIL,
while a threaded scan's tasks on Arrow's threads need the GIL to reach a Python file system
(fsspec: s3fs, memory://). Once a scan had failed on a removed file, a later one waited on
those threads forever (inspection/sql_sources.py `SerialScanDataset`). The check runs in a
child process, so that the code before the fix fails it by a timeout instead of hanging the
suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers.learner import ROOT

QUERIES = 50  # each hung run of the code before the fix hung well within 50 queries

SCRIPT = textwrap.dedent(
    """
    import sys, time, uuid
    import duckdb, pyarrow as pa, pyarrow.parquet as pq
    from gagpo.inspection import sql_sources as src
    from gagpo.storage.store import Store

    store = Store(f"memory://round6-scan-{uuid.uuid4().hex}")
    paths = []
    for i in range(16):
        path = f"{store.root}/shards/f{i}.parquet"
        with store.fs.open(path, "wb") as handle:
            pq.write_table(pa.table({"x": list(range(1000))}), handle)
        paths.append(path)
    source = src.parquet_source(src.arrow_filesystem(store), paths, pa.schema([("x", pa.int64())]))
    for path in paths[1:]:  # what a compaction does to the files a reader named
        store.fs.rm(path)
    con = duckdb.connect()
    con.register("v", source)
    missing = 0
    for _ in range(int(sys.argv[1])):
        try:
            con.sql("SELECT count(*) FROM v").fetchall()
        except duckdb.Error as exc:
            missing += "No such file" in str(exc) or "FileNotFoundError" in str(exc)
    print(f"missing {missing}")
    """
)


def test_queries_over_an_object_stores_removed_files_fail_and_never_hang():
    """50 queries over a memory:// dataset whose files but one were removed: each fails
    (its error says the file is missing: `query_store` then resolves the store again),
    and the process ends. Before: 3 of 3 runs hung inside `to_reader`."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(QUERIES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["missing", str(QUERIES)], done.stdout

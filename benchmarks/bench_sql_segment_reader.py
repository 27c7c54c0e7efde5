"""DuckDB reading Parquet segments through the read-only `gagposegment://` file system of
inspection/sql_segments.py, against DuckDB's own local reader by path (what `gagpo sql` did
before issue 39), on the same files: a count (footers only) and an aggregate (a scan).

    python benchmarks/bench_sql_segment_reader.py [FILES] [ROWS_PER_FILE] [REPEAT]

Defaults: 57 files (a 64 k-group store's segment count, benchmarks/RESULTS.md) of 300 000
rows, 5 runs, the median printed. The files are written once under $TMPDIR and removed.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gagpo.inspection.sql_segments import ReadOnlySegments, segment_url


def write_files(folder: str, n_files: int, rows: int) -> list[str]:
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "a": rng.random(rows),
            "b": rng.integers(0, 100, rows),
            "s": pa.array([f"state-{i % 5000}" for i in range(rows)]),
        }
    )
    first = os.path.join(folder, "0.parquet")
    pq.write_table(table, first, row_group_size=100_000)
    paths = [first]
    for i in range(1, n_files):
        paths.append(os.path.join(folder, f"{i}.parquet"))
        shutil.copyfile(first, paths[-1])
    return paths


def rounded(rows: list[tuple]) -> list[tuple]:
    """Floats to 9 digits: a parallel sum's last bits depend on its threads' order."""
    return [tuple(round(x, 9) if isinstance(x, float) else x for x in row) for row in rows]


def connect(paths: list[str], read_only_fs: bool) -> tuple[duckdb.DuckDBPyConnection, str]:
    con = duckdb.connect(config={"enable_external_access": True})
    if read_only_fs:
        con.register_filesystem(ReadOnlySegments(paths))
        paths = [segment_url(p) for p in paths]
    listed = "[" + ", ".join(f"'{p}'" for p in paths) + "]"
    con.execute(f"SET allowed_paths = {listed}")
    con.execute("SET enable_external_access = false")
    return con, listed


def main(n_files: int = 57, rows: int = 300_000, repeat: int = 5) -> None:
    folder = tempfile.mkdtemp(prefix="gagpo-bench-segments-")
    try:
        paths = write_files(folder, n_files, rows)
        queries = {
            "count": "SELECT count(*) FROM read_parquet({src})",
            "aggregate": "SELECT b, avg(a), count(DISTINCT s) FROM read_parquet({src}) GROUP BY b "
            "ORDER BY b",
        }
        times: dict[str, dict[str, list[float]]] = {"local": {}, "read-only fs": {}}
        answers: dict[str, dict[str, list]] = {"local": {}, "read-only fs": {}}
        for _ in range(repeat):  # the arms interleaved, so load affects both alike
            for arm in times:
                con, src = connect(paths, arm == "read-only fs")
                for name, query in queries.items():
                    start = time.perf_counter()
                    result = con.execute(query.format(src=src)).fetchall()
                    answers[arm][name] = rounded(result)
                    times[arm].setdefault(name, []).append(time.perf_counter() - start)
                con.close()
        mib = os.path.getsize(paths[0]) * n_files / 2**20
        print(f"{n_files} files, {rows} rows each, {mib:.0f} MiB; median of {repeat}")
        for arm, cells in times.items():
            shown = ", ".join(f"{k} {statistics.median(v) * 1000:.0f} ms" for k, v in cells.items())
            print(f"  {arm:13s} {shown}")
        print("  same answers:", answers["local"] == answers["read-only fs"])
        print("  load average:", " ".join(f"{x:.1f}" for x in os.getloadavg()))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))

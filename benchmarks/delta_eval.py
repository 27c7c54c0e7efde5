"""Delta Lake as the store's format, measured (docs/store.md, "Why a manifest of our own").

    pip install --target /tmp/dl deltalake==1.6.6      # not a dependency of gagpo
    python benchmarks/delta_eval.py --shards 'STORE/shards/run=*/*.parquet' --appends 500

Appends the first shard's group to a Delta table N times (one group per commit, as actors
commit shards), then counts the rows with Polars (scan_delta) and DuckDB (over the table's
Arrow dataset), runs optimize.compact() and vacuum, and counts again; beside it, the same
group committed N times with Store.write_shard.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", required=True, help="glob of committed shards")
    parser.add_argument("--appends", type=int, default=500)
    parser.add_argument("--deltalake-path", default="/tmp/dl", help="where deltalake is installed")
    args = parser.parse_args()
    sys.path.insert(0, args.deltalake_path)
    import deltalake
    import duckdb
    import polars as pl
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gagpo.schemas import columns as C
    from gagpo.schemas.layout import new_id
    from gagpo.storage.store import Store

    shard = pq.read_table(sorted(glob.glob(args.shards))[0])
    group = shard.replace_schema_metadata(None)
    table = tempfile.mkdtemp(prefix="delta-eval-")
    t0 = time.perf_counter()
    for _ in range(args.appends):
        deltalake.write_deltalake(table, group, mode="append")
    per_append = (time.perf_counter() - t0) / args.appends
    store = Store(tempfile.mkdtemp(prefix="delta-eval-store-"))
    size = int(shard.schema.metadata[C.META_GROUP_SIZE])
    t0 = time.perf_counter()
    for _ in range(args.appends):
        sid = new_id()
        copy = shard.set_column(
            shard.schema.get_field_index(C.SHARD_ID), C.SHARD_ID, pa.array([sid] * shard.num_rows)
        )
        copy = copy.set_column(
            copy.schema.get_field_index(C.GROUP_ID), C.GROUP_ID, pa.array([sid] * shard.num_rows)
        )
        store.write_shard(copy, group_size=size)
    per_shard = (time.perf_counter() - t0) / args.appends

    def timed(fn):
        start = time.perf_counter()
        value = fn()
        return value, time.perf_counter() - start

    n, polars_before = timed(lambda: pl.scan_delta(table).select(pl.len()).collect().item())
    con = duckdb.connect()
    con.register("delta", deltalake.DeltaTable(table).to_pyarrow_dataset())
    _, duckdb_before = timed(lambda: con.sql("select count(*) from delta").fetchall())
    _, optimize_s = timed(lambda: deltalake.DeltaTable(table).optimize.compact())
    _, vacuum_s = timed(
        lambda: deltalake.DeltaTable(table).vacuum(
            retention_hours=0, enforce_retention_duration=False, dry_run=False
        )
    )
    _, polars_after = timed(lambda: pl.scan_delta(table).select(pl.len()).collect().item())
    print(
        f"deltalake {deltalake.__version__}; {args.appends} commits of one group ({group.num_rows} rows)"
    )
    print(f"  write_deltalake append   {per_append * 1e3:7.1f} ms each")
    print(f"  Store.write_shard        {per_shard * 1e3:7.1f} ms each")
    print(
        f"  polars count ({n} rows)  {polars_before:.3f} s before optimize, {polars_after:.3f} s after"
    )
    print(f"  duckdb count (Arrow)     {duckdb_before:.3f} s before optimize")
    print(
        f"  optimize.compact {optimize_s:.2f} s, vacuum {vacuum_s:.2f} s; "
        f"log entries {len(os.listdir(os.path.join(table, '_delta_log')))}"
    )
    shutil.rmtree(table, ignore_errors=True)
    shutil.rmtree(store.root, ignore_errors=True)


if __name__ == "__main__":
    main()

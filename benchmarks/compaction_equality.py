"""Every view and every recompute of a store, the same before and after `gagpo compact`.

    python benchmarks/compaction_equality.py --store demo-store/20261201-…   # a make demo store

Copies the store (the original is not touched), reads every SQL view of the copy, runs
`gagpo compact --all` on it, and reads every view again: each must return the same rows
(compared sorted, value for value). The `estimators` view's `shards` column counts files,
which compaction changes by design; it is left out. Then GAGPO advantages are recomputed
on a copy of the uncompacted store and on the compacted one: the per-step tables must be
equal value for value (bit-identical floats), though they sit in other files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from gagpo.inspection.sql_views import VIEWS

IGNORED = {"estimators": ["shards"]}  # file counts: what compaction changes on purpose


def views(store: str) -> dict[str, pa.Table]:
    from gagpo.inspection.sql import close_store_db, open_store_db, run_query

    con = open_store_db(store)
    try:
        out = {}
        for view in VIEWS:
            table = run_query(con, f"SELECT * FROM {view}")
            table = table.drop_columns(
                [c for c in IGNORED.get(view, []) if c in table.column_names]
            )
            out[view] = _sorted(table)
        return out
    finally:
        close_store_db(con)


def _sorted(table: pa.Table) -> pa.Table:
    sortable = [c for c in table.column_names if not pa.types.is_nested(table.schema.field(c).type)]
    return (
        table.take(pc.sort_indices(table, [(c, "ascending") for c in sortable]))
        if sortable
        else table
    )


def advantages(store: str) -> pa.Table:
    """GAGPO recomputed over the store, read back as one table sorted by (traj_id, step)."""
    from gagpo.pipeline.config import GagpoConfig
    from gagpo.pipeline.recompute import recompute_store
    from gagpo.storage.archive import step_files
    from gagpo.storage.store import Store

    config = GagpoConfig()
    recompute_store(store, None, config)
    s = Store(store)
    tables = [s.read_table(s.advantages_path(config.tag, i)) for i in step_files(s).ids()]
    table = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    return table.take(pc.sort_indices(table, [("traj_id", "ascending"), ("step", "ascending")]))


def compare(store: str, echo=print) -> list[str]:
    """Differences between the views and recomputes before and after compaction."""
    from gagpo.learner.compact import compact_store
    from gagpo.learner.config import CompactionSettings

    problems = []
    with tempfile.TemporaryDirectory(prefix="gagpo-equality-") as tmp:
        before_dir, after_dir = Path(tmp) / "before", Path(tmp) / "after"
        shutil.copytree(store, before_dir, symlinks=True)
        shutil.copytree(store, after_dir, symlinks=True)
        t0 = time.perf_counter()
        before = views(str(after_dir))
        result = compact_store(str(after_dir), None, True, CompactionSettings(), echo=echo)
        after = views(str(after_dir))
        echo(f"views read twice and compacted in {time.perf_counter() - t0:.1f} s")
        for view in VIEWS:
            same = before[view].equals(after[view])
            echo(f"  {view:20s} {before[view].num_rows:8d} rows  {'same' if same else 'DIFFERENT'}")
            if not same:
                problems.append(
                    f"view {view}: {before[view].num_rows} rows before, "
                    f"{after[view].num_rows} after, not equal"
                )
        a, b = advantages(str(before_dir)), advantages(str(after_dir))
        same = a.equals(b)
        echo(
            f"  recomputed GAGPO     {a.num_rows:8d} steps {'same' if same else 'DIFFERENT'} "
            f"({result.segments} segment(s) after, {len(list((before_dir / 'shards').rglob('*.parquet')))} shards before)"
        )
        if not same:
            problems.append("recomputed advantages differ")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="a local store (it is copied, not changed)")
    problems = compare(parser.parse_args().store)
    for line in problems:
        print(f"DIFFERENT: {line}", file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()

"""`gagpo view` at scale: each page's data call on a large store, before and after compaction.

Builds (or reuses, under --work) a store of N groups the way the store scale benchmark does
(benchmarks/bench_store_scale.py: real sokoban shards of the tiny policy cloned with fresh
ids, one shard per group), stores GAGPO's advantages for every shard (`gagpo advantages
--store`, as the learner would have), copies it, and compacts the copy (`gagpo compact
--store S --all`). Then, on each of the two stores, it times what each page of `gagpo
view` asks for, in-process, through the app's own data functions (inspection/view/data.py)
on one `StoreSession`, as the server calls them:

    run page             run_data: curves per version, held-out, learner metrics
    group list           group_list: the run page's table of groups (by return spread)
    group page, stored   group_view under the stored tag: that group's rows only
    group page, GAGPO    group_view recomputed (GAGPO γ 0.95, λ 0.8) on that group's rows
    compare              compare_view, GRPO, GiGPO, GAGPO λ=0 and λ=0.8, with the Sokoban
                         oracle's credit AUC (workflows/view.py)
    pools                pools_view: per-tag pools and singleton share, the largest pools
    SQL page count       `SELECT count(*) FROM steps` as the SQL page runs it (a fresh
                         connection, like `gagpo sql`)

plus the session's first query (opening the connection: listing and the views). Times are
the best of --repeat, page cache warm. The group is the middle one of the store by id. For
the group page, DuckDB's EXPLAIN ANALYZE says how many step rows the scans returned, which
shows that `WHERE group_id = ?` reached the files (the group's rows, not the store's).

    python benchmarks/bench_view.py --groups 16000 --work /tmp/view16k          # ~15 min here
    python benchmarks/bench_view.py --groups 2000 --seed-store demo-store --repeat 3

Progress goes to stderr; the Markdown table (command, date, machine) to stdout and --out.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_store_scale as scale  # noqa: E402

PAGES = {
    "open": "first query (open the connection: list files, create the views)",
    "run": "run page (`run_data`)",
    "groups": "group list (`group_list`, 50 by return spread)",
    "group_stored": "group page, stored tag (`group_view`)",
    "group_gagpo": "group page, GAGPO recomputed (`group_view`)",
    "compare": "compare page, 4 estimators + oracle AUC (`compare_view`)",
    "pools": "pools page (`pools_view`)",
    "sql_count": "SQL page: `SELECT count(*) FROM steps` (fresh connection)",
}


def log(message: str) -> None:
    scale.log(message)


def cli(argv: list[str], env: dict, timeout_s: float) -> None:
    log(f"  {shlex.join(argv)}")
    proc = scale.run_process(argv, env, timeout_s)
    if proc.rc != 0:
        raise SystemExit(f"{argv[0]} failed (exit {proc.rc}):\n{proc.stderr[-3000:]}")
    log(f"    done in {scale.fmt_s(proc.seconds)} ({proc.rss_mib:.0f} MiB)")


def build(args, env: dict) -> tuple[Path, Path]:
    """The store of N groups with stored advantages (`before`) and its compacted copy
    (`after`), reused when a previous run finished them."""
    work = Path(args.work)
    before, after = work / f"store-{args.groups}", work / f"store-{args.groups}-compacted"
    floor = work / f"floor-{args.groups}.parquet"
    if not (work / f"store-{args.groups}.done").exists():
        seed_dir = Path(args.seed_store) if args.seed_store else scale.build_seed(args, env)
        seed = scale.read_seed(seed_dir)
        log(f"N={args.groups}: cloning {seed_dir} into {before}")
        built = scale.build_store(seed, args.groups, before, floor)
        floor.unlink(missing_ok=True)  # the scale benchmark's one-file floor: not needed here
        log(f"  {built.groups} groups, {built.rows:,} steps, {built.shards} shards")
        cli(
            [scale.gagpo_bin("gagpo"), "advantages", "--store", str(before), "--quiet"],
            env,
            args.timeout,
        )
        (work / f"store-{args.groups}.done").touch()
    else:
        log(f"N={args.groups}: {before} exists: reused")
    if not (work / f"store-{args.groups}-compacted.done").exists():
        shutil.rmtree(after, ignore_errors=True)
        log(f"copying {before} to {after}")
        shutil.copytree(before, after)
        cli(
            [scale.gagpo_bin("gagpo"), "compact", "--store", str(after), "--all"], env, args.timeout
        )
        (work / f"store-{args.groups}-compacted.done").touch()
    return before, after


def scans(session, sql: str, params: list) -> dict:
    """What the table scans of `sql` read, from DuckDB's EXPLAIN ANALYZE: rows out of the
    scans, and Parquet row groups read of those there are (DuckDB's own reads only)."""
    import json

    plan = json.loads(
        session.rows("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)[0]["explain_value"]
    )
    out = {"rows": 0, "row_groups": 0, "row_groups_total": 0}
    stack = list(plan.get("operator", [plan]))
    while stack:
        node = stack.pop()
        stack.extend(node.get("children", []))
        if node.get("type") == "TABLE_SCAN":
            # DuckDB's Parquet reader counts rows_scanned; the Arrow scan, rows it returned
            rows = max(int(node.get("rows_scanned") or 0), int(node.get("intermediate_rows") or 0))
            out["rows"] += rows
            # an empty source (no inbox shard) has nothing to filter
            pushed = "Filters" in node.get("extra_info", {}) or rows == 0
            out["filtered"] = out.get("filtered", True) and pushed
            out["row_groups"] += int(node.get("row_groups_scanned", 0))
            out["row_groups_total"] += int(node.get("total_row_groups_to_scan", 0))
    return out


def measure(url: str, repeat: int) -> tuple[dict[str, scale.Cell], dict]:
    """Each page's data call on `url`, best of `repeat`, on one session kept open (the
    server reopens it 15 s after the last open to see new files: not counted here, but the
    first query is, as `open`)."""
    from gagpo.inspection.sql import Limits
    from gagpo.inspection.view import data, pools
    from gagpo.workflows.view import EnvironmentOracle

    data.REFRESH_S = float("inf")  # one connection for the whole measurement
    limits = Limits(timeout_s=0)
    session = data.StoreSession("bench", url, limits=limits)
    cells: dict[str, scale.Cell] = {}
    t0 = time.perf_counter()
    session.query("SELECT 1")
    cells["open"] = scale.Cell(seconds=time.perf_counter() - t0)
    log(f"    open {scale.fmt_s(cells['open'].seconds)}")
    ids = session.rows("SELECT DISTINCT group_id FROM steps ORDER BY group_id")  # untimed setup
    group = ids[len(ids) // 2]["group_id"]
    tag = session.rows("SELECT estimator FROM estimators ORDER BY estimator")[0]["estimator"]
    compare = [(name, {}) for name in ("grpo", "gigpo", "gagpo_lambda0", "gagpo")]
    oracle = EnvironmentOracle()
    calls = {
        "run": lambda: data.run_data(session),
        "groups": lambda: data.group_list(session),
        "group_stored": lambda: data.group_view(session, group, f"stored:{tag}", {}),
        "group_gagpo": lambda: data.group_view(session, group, "gagpo", {}),
        "compare": lambda: data.compare_view(session, group, compare, oracle=oracle),
        "pools": lambda: pools.pools_view(session),
        "sql_count": lambda: session.fresh_query("SELECT count(*) FROM steps", limits),
    }
    for name, call in calls.items():
        cells[name] = scale.time_call(call, repeat, name)
    columns = ", ".join(f'"{c}"' for c in data.STEP_COLUMNS)
    read = scans(
        session, f"SELECT {columns} FROM steps WHERE group_id = ? ORDER BY traj_id, step", [group]
    )
    read["group_rows"] = session.rows(
        "SELECT count(*) AS n FROM steps WHERE group_id = ?", [group]
    )[0]["n"]
    read["store_rows"] = session.rows("SELECT count(*) AS n FROM steps")[0]["n"]
    session.close()
    return cells, read


def pushdown_text(read: dict) -> str:
    groups = (
        f"{read['row_groups']} of {read['row_groups_total']} row groups, "
        if read["row_groups_total"]
        else ""
    )
    pushed = (
        "the filter in every scan, " if read.get("filtered") else "NOT pushed into every scan, "
    )
    return (
        f"{pushed}{groups}{read['rows']:,} rows out of the scans "
        f"(the group has {read['group_rows']:,} of the store's {read['store_rows']:,})"
    )


def report(args, argv: list[str], results: dict, layouts: dict) -> str:
    when = datetime.date.today().isoformat()
    lines = [
        f"`python benchmarks/bench_view.py {shlex.join(argv)}`",
        "",
        f"- machine: {scale.cpu_model()}, {scale.nproc()} cores, {scale.mem_gib():.0f} GiB; "
        f"Python {platform.python_version()}, duckdb {scale.pkg_version('duckdb')}, pyarrow "
        f"{scale.pkg_version('pyarrow')}, polars {scale.pkg_version('polars')}; {when}",
        f"- checkout: {scale.git_state()}",
        f"- best of {args.repeat}, in-process, one session per store, page cache warm",
    ]
    for phase, layout in layouts.items():
        lines.append(
            f"- {phase}: {layout['shards']:,} shards ({layout['shard_bytes'] / 2**20:.0f} "
            f"MiB), {layout['segments']} segments "
            f"({layout['segment_bytes'] / 2**20:.0f} MiB)"
        )
    for phase, (_, read) in results.items():
        lines.append(f"- group page's scan of `steps`, {phase}: {pushdown_text(read)}")
    header = ["page (data call)", *[f"{args.groups:,} groups, {p}" for p in results]]
    rows = [
        [label, *[scale.cell_text(results[p][0].get(key)) for p in results]]
        for key, label in PAGES.items()
    ]
    lines += ["", scale.table(header, rows)]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=16000, help="store size (default 16000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per call; the best counts")
    scale.add_seed_arguments(
        parser, "gagpo-view-scale", "stores (kept and reused), HOME and TMPDIR of the CLIs"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=7200.0,
        metavar="S",
        help="kill a CLI run (advantages, compact) after S seconds",
    )
    parser.add_argument("--out", default=None, metavar="FILE", help="also write the table here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import os

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    work = Path(args.work)
    for sub in ("home", "tmp"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HOME": str(work / "home"),
        "TMPDIR": str(work / "tmp"),
        "PYTHONUNBUFFERED": "1",
    }
    env.setdefault("GAGPO_CACHE", str(ROOT / ".cache" / "gagpo"))
    before, after = build(args, env)
    results, layouts = {}, {}
    for phase, store in (("before compaction", before), ("compacted", after)):
        log(f"{phase}: {store}")
        layouts[phase] = scale.describe_store(store)
        results[phase] = measure(str(store), args.repeat)
    text = report(args, argv, results, layouts)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

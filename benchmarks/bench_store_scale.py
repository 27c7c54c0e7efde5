"""Store scale benchmark: what reading a store costs as it grows, before and after compaction.

Actors commit one Parquet shard per group under STORE/shards/run=<id>/; every reader of
the inbox lists and opens all of them. This benchmark clones a seed store of real shards
(the tiny policy on sokoban, or --seed-store) into stores of N groups, each clone with
fresh shard/group/rollout ids (a clone prefix), and measures for each N, before and after
`gagpo compact --store S --all`:

    gagpo sql  "select count(*) from steps"            next to DuckDB on ONE Parquet file
    gagpo sql  per-policy-version success (trajectories) next to the same SQL on that file
    gagpo advantages --store S                          next to gagpo advantages --input one.parquet
    Store(S).list_shards()                              the learner's poll (in-process)
    archive.step_files(Store(S))                        the one reader's resolution (in-process)
    Throttle(Store(S)).backlog()                        the actor's backpressure check (in-process;
                                                        cold: a new Throttle, warm: its second call)
    gagpo compact --store S --all                       the compaction itself (one run)

The one file (the floor) holds the same rows as the store, in row groups of the segments'
size. CLI rows are wall-clock times of a subprocess (interpreter start-up included); the
floor is timed both in-process and as `python -c "import duckdb; ..."` so that CLI rows
compare with a process that pays the same start-up. Times are the best of --repeat; the
compaction runs once. Every file was just written, so the page cache is warm throughout.
Each answer is checked (row counts, the policy rows against the floor's, the steps the
advantage stage wrote), and a wrong or failed one is marked in its cell.

    python benchmarks/bench_store_scale.py --groups 200 1000 --repeat 2     # a minute or two
    nice -n 10 python benchmarks/bench_store_scale.py --groups 1000 16000 --repeat 2 \\
        --skip-before-above 16000 --out /tmp/scale/result.md
    python benchmarks/bench_store_scale.py --seed-store demo-store --only sql_count,compact

Progress goes to stderr; the Markdown tables (command, date, machine) to stdout and --out.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import io
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gagpo.schemas import columns as C  # noqa: E402

ROW_GROUP_ROWS = 16_384  # the floor's row groups: the segments' size (storage/compaction.py)
with contextlib.suppress(ImportError):  # before compaction existed: its rows fail and say so
    from gagpo.storage.compaction import ROW_GROUP_ROWS

# The measurements, in the order they run (the SQL rows before the advantage stage writes
# advantages/, whose footers `gagpo sql` would read too).
ROWS = {
    "sql_count": "gagpo sql: count(*) from steps",
    "sql_policy": "gagpo sql: success per policy version (trajectories)",
    "advantages": "gagpo advantages --store (recompute, gagpo)",
    "list_shards": "Store.list_shards()",
    "step_files": "archive.step_files()",
    "backlog": "Throttle.backlog()",
    "compact": "gagpo compact --all",
}
CLI_ROWS = ("sql_count", "sql_policy", "advantages")  # the slow ones --skip-before-above skips

SQL_COUNT = "select count(*) from steps"
SQL_POLICY = (
    "select policy_version, count(*) as rollouts, avg(success::double) as success_rate "
    "from trajectories group by policy_version order by policy_version"
)
# The floor's SQL: the trajectories view of inspection/sql_views.py over one file.
FLOOR_TRAJECTORIES = """
with steps as (select * from read_parquet('{path}')),
trajectories as (
    select run_id, shard_id, group_id, traj_id,
           any_value(env) as env, any_value(task_id) as task_id,
           min(policy_version) as policy_version, count(*) as length,
           sum(reward::double) as "return", arg_max(won, step) as success,
           arg_max(truncated, step) as truncated,
           count(*) filter (where not action_valid) as invalid_actions,
           min(created_at) as started_at, max(created_at) as ended_at
    from steps group by run_id, shard_id, group_id, traj_id
)
"""
FLOOR_COUNT = "select count(*) from read_parquet('{path}')"


def sql_argv(gagpo: str, store, query: str) -> list[str]:
    """`gagpo sql` on `store`, CSV out, no time limit."""
    return [gagpo, "sql", "--store", str(store), "--format", "csv", "--timeout", "0", query]


FLOOR_POLICY = FLOOR_TRAJECTORIES + SQL_POLICY


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- measurements ------------------------------------------------------------------------
@dataclass
class Cell:
    seconds: float | None = None  # best of the repeats (None: not measured)
    runs: list[float] = field(default_factory=list)
    rss_mib: float | None = None  # peak RSS of a CLI run (the largest of the repeats)
    problem: str | None = None  # a failed run or a wrong answer
    skipped: str | None = None
    value: object = None  # what it answered (for the checks)


@dataclass
class Proc:
    rc: int
    stdout: str
    stderr: str
    seconds: float
    rss_mib: float


def run_process(argv: list[str], env: dict, timeout_s: float) -> Proc:
    """Run `argv`, wall-clock timed; its own peak RSS from wait4 (not the children's max)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True
        )
        timer = threading.Timer(timeout_s, lambda: _kill_group(proc.pid))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Proc(proc.returncode, out.read(), err.read(), seconds, usage.ru_maxrss / 1024)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def first_error_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "error" in line.lower() or "Error" in line:
            return line[:200]
    return (lines[-1] if lines else "no output")[:200]


def time_cli(
    argv: list[str], env: dict, repeat: int, timeout_s: float, what: str, check=None
) -> Cell:
    """Best of `repeat` runs of `argv`; `check(proc)` returns (value, problem or None)."""
    cell = Cell()
    for i in range(repeat):
        proc = run_process(argv, env, timeout_s)
        if proc.rc != 0:
            reason = "killed (timeout)" if proc.rc in (-9, 137) else f"exit {proc.rc}"
            cell.problem = f"FAILED ({reason}: {first_error_line(proc.stderr or proc.stdout)})"
            log(f"    {what}: {cell.problem}")
            return cell
        cell.rss_mib = max(cell.rss_mib or 0.0, proc.rss_mib)
        note_run(
            cell,
            proc.seconds,
            proc,
            check,
            f"{what}: run {i + 1}/{repeat}",
            f" ({proc.rss_mib:.0f} MiB)",
        )
    cell.seconds = min(cell.runs)
    return cell


def note_run(cell: Cell, seconds: float, result, check, what: str, extra: str = "") -> None:
    """Record one timed run in `cell`, check its result, and log the line."""
    cell.runs.append(seconds)
    if check is not None:
        cell.value, problem = check(result)
        if problem and not cell.problem:
            cell.problem = problem
    log(f"    {what} {fmt_s(seconds)}{extra}" + (f"  {cell.problem}" if cell.problem else ""))


def time_call(fn, repeat: int, what: str, setup=None, check=None) -> Cell:
    """Best of `repeat` in-process calls of `fn(setup())` (setup untimed)."""
    cell = Cell()
    for i in range(repeat):
        arg = setup() if setup is not None else None
        t0 = time.perf_counter()
        try:
            value = fn(arg) if setup is not None else fn()
        except Exception as exc:
            cell.problem = f"FAILED ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
            log(f"    {what}: {cell.problem}")
            return cell
        note_run(cell, time.perf_counter() - t0, value, check, f"{what}: run {i + 1}/{repeat}")
    cell.seconds = min(cell.runs)
    return cell


# --- the seed and its clones ---------------------------------------------------------------
@dataclass
class SeedShard:
    run_id: str
    shard_id: str
    table: pa.Table
    metadata: dict[bytes, bytes]
    groups: list[str]
    trajs: list[str]  # distinct traj ids
    traj_group: list[int | None]  # index into groups of the group each traj id starts with
    group_index: pa.Array  # per row: index into groups
    traj_index: pa.Array  # per row: index into trajs


def build_seed(args, env: dict) -> Path:
    seed = Path(args.work) / "seed"
    if (seed / "shards").is_dir() and any((seed / "shards").glob("run=*/*.parquet")):
        log(f"seed store {seed} exists: reused (remove it for a fresh one)")
        return seed
    argv = [
        gagpo_bin("gagpo-actors"),
        "--store",
        str(seed),
        "--env",
        args.seed_env,
        "--policy",
        args.seed_policy,
        "--groups",
        str(args.seed_groups),
        "--group-size",
        str(args.seed_group_size),
        "--seed",
        str(args.seed),
        "--quiet",
    ]
    log(f"building the seed store: {shlex.join(argv)}")
    proc = run_process(argv, env, timeout_s=args.timeout)
    if proc.rc != 0:
        raise SystemExit(f"gagpo-actors failed (exit {proc.rc}):\n{proc.stderr[-3000:]}")
    log(f"  seed built in {fmt_s(proc.seconds)}: {proc.stdout.strip().splitlines()[0]}")
    return seed


def read_seed(seed: Path) -> list[SeedShard]:
    from gagpo.storage.store import Store

    store = Store(str(seed))
    refs = store.list_shards()
    if not refs:
        raise SystemExit(f"seed store {seed} has no committed shard under shards/")
    shards = []
    for ref in refs:
        table = store.read_table(ref.path)
        metadata = dict(table.schema.metadata or {})
        if C.META_SCHEMA_VERSION not in metadata or C.META_GROUP_SIZE not in metadata:
            raise SystemExit(f"seed shard {ref.path} lacks the gagpo metadata keys")
        table = table.replace_schema_metadata(None)
        groups = pc.unique(table[C.GROUP_ID]).to_pylist()
        trajs = pc.unique(table[C.TRAJ_ID]).to_pylist()
        owner = {}
        for g, t in zip(table[C.GROUP_ID].to_pylist(), table[C.TRAJ_ID].to_pylist(), strict=True):
            owner.setdefault(t, g)
        where = {g: i for i, g in enumerate(groups)}
        traj_group = [where[owner[t]] if t.startswith(owner[t]) else None for t in trajs]
        shards.append(
            SeedShard(
                ref.run_id,
                ref.shard_id,
                table,
                metadata,
                groups,
                trajs,
                traj_group,
                pc.index_in(table[C.GROUP_ID], value_set=pa.array(groups, pa.string())),
                pc.index_in(table[C.TRAJ_ID], value_set=pa.array(trajs, pa.string())),
            )
        )
    return shards


def clone_table(shard: SeedShard, clone: int) -> tuple[pa.Table, str]:
    """The seed shard's table with fresh ids: `c<clone>-` before each shard and group id (a
    rollout id that starts with its group's id gets the new group id in its place).

    A prefix, not a suffix: sorted by id (the inbox's listing order, the segments' row
    order) the store is clone after clone, as the floor file is, and as a real store's
    later groups come later. Sorted by a suffix, a segment would hold every clone of a
    seed group side by side: identical bytes in a row that zstd compresses away, which
    makes segments unrealistically small and fast to read next to the floor."""
    prefix = f"c{clone:06d}-"
    shard_id = prefix + shard.shard_id
    groups = [prefix + g for g in shard.groups]
    trajs = [
        prefix + t if gi is None else groups[gi] + t[len(shard.groups[gi]) :]
        for t, gi in zip(shard.trajs, shard.traj_group, strict=True)
    ]
    table = shard.table
    n = table.num_rows
    replace = {
        C.SHARD_ID: pa.array([shard_id] * n, pa.string()),
        C.GROUP_ID: pa.array(groups, pa.string()).take(shard.group_index),
        C.TRAJ_ID: pa.array(trajs, pa.string()).take(shard.traj_index),
    }
    for name, column in replace.items():
        table = table.set_column(
            table.schema.get_field_index(name), table.schema.field(name), column
        )
    return table, shard_id


@dataclass
class Built:
    groups: int = 0
    rollouts: int = 0
    rows: int = 0
    shards: int = 0
    shard_bytes: int = 0
    floor_bytes: int = 0
    seconds: float = 0.0


def build_store(seed: list[SeedShard], n_groups: int, store: Path, floor: Path) -> Built:
    """Clone the seed's shards (whole shards, cycling) until the store holds n_groups
    groups; write the same rows as one Parquet file `floor` too."""
    t0 = time.perf_counter()
    shutil.rmtree(store, ignore_errors=True)
    floor.unlink(missing_ok=True)
    built = Built()
    writer = None
    pending: list[pa.Table] = []
    pending_rows = 0
    group_size = int(seed[0].metadata[C.META_GROUP_SIZE])
    made_dirs: set[Path] = set()
    clone = 0
    last_report = time.monotonic()
    try:
        while built.groups < n_groups:
            for shard in seed:
                if built.groups >= n_groups:
                    break
                table, shard_id = clone_table(shard, clone)
                folder = store / "shards" / f"run={shard.run_id}"
                if folder not in made_dirs:
                    folder.mkdir(parents=True, exist_ok=True)
                    made_dirs.add(folder)
                path = folder / f"{shard_id}.parquet"
                pq.write_table(
                    table.replace_schema_metadata(shard.metadata), path, compression="zstd"
                )
                if clone == 0:  # the first clone of each seed shard, read back as readers do
                    check_shard(path, shard.metadata)
                built.shard_bytes += path.stat().st_size
                built.shards += 1
                built.groups += len(shard.groups)
                built.rollouts += len(shard.trajs)
                built.rows += table.num_rows
                pending.append(table)
                pending_rows += table.num_rows
                if pending_rows >= ROW_GROUP_ROWS:
                    writer = _flush(writer, floor, pending, seed[0].metadata)
                    pending, pending_rows = [], 0
                if time.monotonic() - last_report > 10:
                    log(
                        f"    cloned {built.groups}/{n_groups} groups "
                        f"({built.groups / (time.perf_counter() - t0):.0f}/s)"
                    )
                    last_report = time.monotonic()
            clone += 1
        if pending:
            writer = _flush(writer, floor, pending, seed[0].metadata)
    finally:
        if writer is not None:
            writer.close()
    if any(int(s.metadata[C.META_GROUP_SIZE]) != group_size for s in seed):
        log("  note: the seed's shards have several group sizes")
    built.floor_bytes = floor.stat().st_size
    built.seconds = time.perf_counter() - t0
    return built


def check_shard(path: Path, metadata: dict[bytes, bytes]) -> None:
    """The clone is a shard every reader accepts: validated as the learner reads it, with
    the seed's metadata keys, named by its shard id."""
    from gagpo.storage.store import Store

    table = Store(str(path.parent)).read_shard(str(path))  # raises ValidationError
    written = table.schema.metadata or {}
    for key in (C.META_SCHEMA_VERSION, C.META_GROUP_SIZE):
        if written.get(key) != metadata[key]:
            raise SystemExit(f"clone {path}: metadata {key!r} is {written.get(key)!r}")
    shard_ids = pc.unique(table[C.SHARD_ID]).to_pylist()
    if shard_ids != [path.stem] or path.parent.name != f"run={table[C.RUN_ID][0].as_py()}":
        raise SystemExit(
            f"clone {path}: shard_id {shard_ids} or run folder does not match its name"
        )


def _flush(writer, floor: Path, tables: list[pa.Table], metadata: dict[bytes, bytes]):
    table = pa.concat_tables(tables)
    if writer is None:
        writer = pq.ParquetWriter(floor, table.schema.with_metadata(metadata), compression="zstd")
    writer.write_table(table.replace_schema_metadata(metadata), row_group_size=ROW_GROUP_ROWS)
    return writer


# --- the rows --------------------------------------------------------------------------------
def gagpo_bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found beside {sys.executable} nor on PATH")
    return found


def parse_csv(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text.strip())))


def same_rows(got: list[tuple], want: list[tuple]) -> bool:
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if len(a) != len(b):
            return False
        for x, y in zip(a, b, strict=True):
            try:
                if abs(float(x) - float(y)) > 1e-9 * max(1.0, abs(float(y))):
                    return False
            except (TypeError, ValueError):
                if str(x) != str(y):
                    return False
    return True


class Bench:
    def __init__(self, args, env: dict) -> None:
        self.args, self.env = args, env
        self.work = Path(args.work)
        self.results: dict[int, dict[str, Cell]] = {}
        self.built: dict[int, Built] = {}
        self.layout: dict[int, dict[str, object]] = {}
        self.startup: dict[str, Cell] = {}
        self.seed_note = ""
        self.load_start = os.getloadavg()[0]
        self.git_start = git_state()  # the code under test may change while this runs

    def want(self, row: str) -> bool:
        return row in self.args.only

    # one N ----------------------------------------------------------------------------
    def measure(self, n: int, built: Built, store: Path, floor: Path) -> None:
        a = self.args
        res = self.results.setdefault(n, {})
        skip_before = a.skip_before_above is not None and n > a.skip_before_above
        floor_policy = None

        # floors first: their answers check the store's
        if self.want("sql_count") or self.want("sql_policy"):
            import duckdb

            for row, query, expected in (
                ("sql_count", FLOOR_COUNT, [(built.rows,)]),
                ("sql_policy", FLOOR_POLICY, None),
            ):
                if not self.want(row):
                    continue
                sql = query.format(path=floor)

                def run_duckdb(sql=sql):
                    con = duckdb.connect()
                    try:
                        return con.sql(sql).fetchall()
                    finally:
                        con.close()

                def check(value, expected=expected):
                    if expected is not None and not same_rows(value, expected):
                        return value, f"⚠ answered {value[:3]}, expected {expected}"
                    return value, None

                res[f"{row}.floor"] = cell = time_call(
                    run_duckdb, a.repeat, f"N={n} {row} floor (duckdb in-process)", check=check
                )
                if row == "sql_policy":
                    floor_policy = cell.value
                code = f"import duckdb; print(duckdb.sql({sql!r}).fetchall())"
                res[f"{row}.floor_cli"] = time_cli(
                    [sys.executable, "-c", code],
                    self.env,
                    a.repeat,
                    a.timeout,
                    f"N={n} {row} floor (python -c duckdb)",
                )

        if self.want("advantages"):
            out = self.work / "floor-advantages.parquet"
            argv = [
                gagpo_bin("gagpo"),
                "advantages",
                "--input",
                str(floor),
                "--out",
                str(out),
                "--compression",
                "zstd",
                "--quiet",
            ]

            def check_floor(proc):
                rows = pq.ParquetFile(out).metadata.num_rows
                return (
                    rows,
                    None if rows == built.rows else f"⚠ wrote {rows} rows, expected {built.rows}",
                )

            res["advantages.floor"] = time_cli(
                argv,
                self.env,
                a.repeat,
                a.timeout,
                f"N={n} advantages floor (--input one file)",
                check_floor,
            )
            out.unlink(missing_ok=True)

        for phase in ("before", "after"):
            if phase == "after":
                if not self.need_compaction():
                    break
                self.compact(n, store, res)
            self.layout.setdefault(n, {})[phase] = describe_store(store)
            self.cli_rows(
                n, store, built, res, phase, skip_before and phase == "before", floor_policy
            )
            self.library_rows(n, store, built, res, phase)

    def need_compaction(self) -> bool:
        return any(self.want(r) for r in ROWS)

    def compact(self, n: int, store: Path, res: dict[str, Cell]) -> None:
        # the before-rows' advantage tables go first: every N compacts steps only
        shutil.rmtree(store / "advantages", ignore_errors=True)
        argv = [gagpo_bin("gagpo"), "compact", "--store", str(store), "--all"]
        log(f"  N={n}: {shlex.join(argv)}")

        def check(proc):
            said = proc.stdout.strip().splitlines()
            inner = re.search(r" in ([\d.]+) s", proc.stdout)
            return (said[-1] if said else "", float(inner.group(1)) if inner else None), None

        res["compact.after"] = cell = time_cli(
            argv, self.env, 1, self.args.timeout, f"N={n} compact", check
        )
        if cell.value:
            log(f"    {cell.value[0]}")

    def cli_rows(self, n, store, built, res, phase, skip, floor_policy) -> None:
        a = self.args
        gagpo = gagpo_bin("gagpo")
        for row in CLI_ROWS:
            if not self.want(row):
                continue
            key = f"{row}.{phase}"
            if skip:
                res[key] = Cell(skipped=f"skipped (--skip-before-above {a.skip_before_above})")
                continue
            if row == "sql_count":
                argv = sql_argv(gagpo, store, SQL_COUNT)

                def check(proc):
                    rows = parse_csv(proc.stdout)
                    got = rows[1][0] if len(rows) > 1 and rows[1] else None
                    ok = got is not None and got.isdigit() and int(got) == built.rows
                    return got, None if ok else f"⚠ count {got}, expected {built.rows}"
            elif row == "sql_policy":
                argv = sql_argv(gagpo, store, SQL_POLICY)

                def check(proc):
                    rows = [tuple(r) for r in parse_csv(proc.stdout)[1:]]
                    if floor_policy is None:
                        return rows, None
                    ok = same_rows(rows, floor_policy)
                    return (
                        rows,
                        None if ok else f"⚠ answered {rows[:3]}, the floor {floor_policy[:3]}",
                    )
            else:
                argv = [gagpo, "advantages", "--store", str(store), "--quiet"]

                def check(proc):
                    said = re.search(r"(\d+) steps", proc.stdout)
                    steps = int(said.group(1)) if said else None
                    ok = steps == built.rows
                    return steps, None if ok else f"⚠ wrote {steps} steps, expected {built.rows}"

            res[key] = time_cli(argv, self.env, a.repeat, a.timeout, f"N={n} {row} {phase}", check)

    def library_rows(self, n, store, built, res, phase) -> None:
        from gagpo.actors.throttle import Throttle
        from gagpo.storage.store import Store

        a = self.args
        url = str(store)
        if self.want("list_shards"):
            expected = built.shards if phase == "before" else 0

            def check(refs):
                ok = len(refs) == expected
                return len(refs), None if ok else f"⚠ {len(refs)} shard(s), expected {expected}"

            res[f"list_shards.{phase}"] = time_call(
                lambda: Store(url).list_shards(),
                a.repeat,
                f"N={n} list_shards {phase}",
                check=check,
            )
        if self.want("step_files"):
            try:
                from gagpo.storage.archive import step_files
            except ImportError as exc:
                res[f"step_files.{phase}"] = Cell(problem=f"FAILED (ImportError: {exc})")
            else:

                def check(files):
                    groups = files.manifest.groups if files.manifest else 0
                    groups += built.groups // max(built.shards, 1) * len(files.shards)
                    text = f"{len(files.segments)} segment(s) + {len(files.shards)} shard(s)"
                    ok = groups == built.groups
                    return (
                        text,
                        None if ok else f"⚠ {text} hold {groups} groups, expected {built.groups}",
                    )

                res[f"step_files.{phase}"] = time_call(
                    lambda: step_files(Store(url)),
                    a.repeat,
                    f"N={n} step_files {phase}",
                    check=check,
                )
        if self.want("backlog"):

            def check(backlog):
                return backlog.groups, None

            res[f"backlog_cold.{phase}"] = time_call(
                lambda t: t.backlog(),
                a.repeat,
                f"N={n} backlog cold {phase}",
                setup=lambda: Throttle(Store(url)),
                check=check,
            )

            def warm_throttle():
                throttle = Throttle(Store(url))
                throttle.backlog()
                return throttle

            res[f"backlog_warm.{phase}"] = time_call(
                lambda t: t.backlog(),
                a.repeat,
                f"N={n} backlog warm {phase}",
                setup=warm_throttle,
                check=check,
            )

    def measure_startup(self) -> None:
        if not (self.want("sql_count") or self.want("sql_policy") or self.want("advantages")):
            return
        log("start-up references")
        self.startup["python -c 'import duckdb'"] = time_cli(
            [sys.executable, "-c", "import duckdb"],
            self.env,
            self.args.repeat,
            self.args.timeout,
            "python -c 'import duckdb'",
        )
        self.startup["gagpo sql --help"] = time_cli(
            [gagpo_bin("gagpo"), "sql", "--help"],
            self.env,
            self.args.repeat,
            self.args.timeout,
            "gagpo sql --help",
        )


def describe_store(store: Path) -> dict[str, object]:
    """Files and bytes of the store's steps: inbox shards, archive segments."""
    shards = list((store / "shards").glob("run=*/*.parquet"))
    segments = list((store / "archive" / "segments").glob("*.parquet"))
    return {
        "shards": len(shards),
        "shard_bytes": sum(p.stat().st_size for p in shards),
        "segments": len(segments),
        "segment_bytes": sum(p.stat().st_size for p in segments),
    }


# --- the report ------------------------------------------------------------------------------
def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"
    if seconds < 100:
        return f"{seconds:.2f} s"
    return f"{seconds:.0f} s"


def fmt_ratio(r: float | None) -> str:
    if r is None:
        return "—"
    if r >= 100:
        return f"{r:.0f}×"
    if r >= 10:
        return f"{r:.1f}×"
    return f"{r:.2f}×"


def cell_text(cell: Cell | None) -> str:
    if cell is None:
        return "—"
    if cell.skipped:
        return "skipped"
    if cell.seconds is None:
        return cell.problem or "—"
    text = fmt_s(cell.seconds)
    return f"{text} {cell.problem}" if cell.problem else text


def seconds(cell: Cell | None) -> float | None:
    return None if cell is None or cell.seconds is None else cell.seconds


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def report(bench: Bench, argv: list[str], started: float) -> str:
    a = bench.args
    ns = sorted(bench.results)
    n0 = ns[0] if ns else None
    head = ["measurement"] + [f"N = {n:,}" for n in ns]
    R = bench.results

    def get(n, key):
        return R.get(n, {}).get(key)

    out = [f"# Store scale: {', '.join(f'{n:,}' for n in ns)} groups", ""]
    out.append(
        f"- command: `python benchmarks/bench_store_scale.py {shlex.join(argv)}` "
        f"(niceness {os.nice(0)})"
    )
    out.append(
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}; "
        f"ran {fmt_s(time.perf_counter() - started)}"
    )
    out.append(
        f"- machine: {platform.node()}, {os.cpu_count()} cores (nproc {nproc()}), "
        f"{cpu_model()}, {mem_gib():.0f} GiB; Python {platform.python_version()} "
        f"({platform.platform()})"
    )
    out.append(
        f"- load average (1 min) at the start / now: {bench.load_start:.2f} / "
        f"{os.getloadavg()[0]:.2f} (other processes share the cores)"
    )
    out.append(f"- versions: duckdb {pkg_version('duckdb')}, pyarrow {pa.__version__}")
    now = git_state()
    out.append(
        f"- checkout: {now}"
        if now == bench.git_start
        else f"- checkout at the start: {bench.git_start}; now: {now} (changed while it ran)"
    )
    out.append(
        f"- best of {a.repeat} (compaction: one run); wall-clock; CLI rows are subprocesses "
        "(start-up included), library rows in-process; page cache warm (every file just written)"
    )
    if bench.seed_note:
        out.append(f"- seed: {bench.seed_note}")
    if bench.startup:
        out.append(
            "- start-up alone: "
            + "; ".join(f"`{k}` {cell_text(c)}" for k, c in bench.startup.items())
        )
    out.append("")

    # the stores
    rows = []
    B, L = bench.built, bench.layout

    def per_n(fn):
        return [fn(n) if n in B else "—" for n in ns]

    rows.append(["groups / rollouts", *per_n(lambda n: f"{B[n].groups:,} / {B[n].rollouts:,}")])
    rows.append(["steps (rows)", *per_n(lambda n: f"{B[n].rows:,}")])
    rows.append(
        [
            "before: inbox shards (MiB)",
            *per_n(lambda n: f"{B[n].shards:,} ({B[n].shard_bytes / 2**20:,.0f})"),
        ]
    )
    if any("after" in L.get(n, {}) for n in ns):
        rows.append(
            [
                "after: segments (MiB) + inbox shards",
                *per_n(
                    lambda n: (
                        f"{L[n]['after']['segments']} ({L[n]['after']['segment_bytes'] / 2**20:,.0f}) + "
                        f"{L[n]['after']['shards']}"
                        if "after" in L.get(n, {})
                        else "—"
                    )
                ),
            ]
        )
    rows.append(["floor: one file (MiB)", *per_n(lambda n: f"1 ({B[n].floor_bytes / 2**20:,.0f})")])
    rows.append(["cloning the store + floor (this script)", *per_n(lambda n: fmt_s(B[n].seconds))])
    out += ["## Stores", "", table(head, rows), ""]

    # absolute times
    lines: list[tuple[str, str]] = []  # (label, key)
    for row in ("sql_count", "sql_policy"):
        if bench.want(row):
            lines += [
                (f"{ROWS[row]}: before", f"{row}.before"),
                (f"{ROWS[row]}: after", f"{row}.after"),
                ("  floor: duckdb in-process, one file", f"{row}.floor"),
                ("  floor: python -c duckdb, one file", f"{row}.floor_cli"),
            ]
    if bench.want("advantages"):
        lines += [
            (f"{ROWS['advantages']}: before", "advantages.before"),
            (f"{ROWS['advantages']}: after", "advantages.after"),
            ("  floor: gagpo advantages --input one file", "advantages.floor"),
        ]
    for row in ("list_shards", "step_files"):
        if bench.want(row):
            lines += [
                (f"{ROWS[row]}: before", f"{row}.before"),
                (f"{ROWS[row]}: after", f"{row}.after"),
            ]
    if bench.want("backlog"):
        lines += [
            (f"{ROWS['backlog']} cold (new Throttle): before", "backlog_cold.before"),
            (f"{ROWS['backlog']} cold (new Throttle): after", "backlog_cold.after"),
            (f"{ROWS['backlog']} warm (2nd call): before", "backlog_warm.before"),
            (f"{ROWS['backlog']} warm (2nd call): after", "backlog_warm.after"),
        ]
    if any(get(n, "compact.after") for n in ns):
        lines.append((ROWS["compact"] + " (wall, one run)", "compact.after"))
    rows = [[label] + [cell_text(get(n, key)) for n in ns] for label, key in lines]
    out += ["## Times (best of the repeats)", "", table(head, rows), ""]

    # ratios
    rows = [["groups: N / N₀"] + [fmt_ratio(n / n0) for n in ns]]

    def add(label, fn):
        values = [fn(n) for n in ns]
        if any(v is not None for v in values):
            rows.append([label] + [fmt_ratio(v) for v in values])

    def s(n, key):
        return seconds(get(n, key))

    for row in ("sql_count", "sql_policy"):
        if not bench.want(row):
            continue
        name = {"sql_count": "sql count", "sql_policy": "sql policy"}[row]
        add(
            f"{name}: after / floor (python -c)",
            lambda n, r=row: ratio(s(n, f"{r}.after"), s(n, f"{r}.floor_cli")),
        )
        add(
            f"{name}: before / floor (python -c)",
            lambda n, r=row: ratio(s(n, f"{r}.before"), s(n, f"{r}.floor_cli")),
        )
        add(
            f"{name}: before / after",
            lambda n, r=row: ratio(s(n, f"{r}.before"), s(n, f"{r}.after")),
        )
        for phase in ("before", "after", "floor_cli"):
            add(
                f"{name}: {phase.replace('floor_cli', 'floor (python -c)')} at N / at N₀",
                lambda n, r=row, p=phase: ratio(s(n, f"{r}.{p}"), s(n0, f"{r}.{p}")),
            )
    if bench.want("advantages"):
        add(
            "advantages: after / floor",
            lambda n: ratio(s(n, "advantages.after"), s(n, "advantages.floor")),
        )
        add(
            "advantages: before / floor",
            lambda n: ratio(s(n, "advantages.before"), s(n, "advantages.floor")),
        )
        add(
            "advantages: before / after",
            lambda n: ratio(s(n, "advantages.before"), s(n, "advantages.after")),
        )
        for phase in ("before", "after", "floor"):
            add(
                f"advantages: {phase} at N / at N₀",
                lambda n, p=phase: ratio(s(n, f"advantages.{p}"), s(n0, f"advantages.{p}")),
            )
    for row, name in (
        ("list_shards", "list_shards"),
        ("step_files", "step_files"),
        ("backlog_cold", "backlog cold"),
        ("backlog_warm", "backlog warm"),
    ):
        if not bench.want(row.split("_")[0] if row.startswith("backlog") else row):
            continue
        add(
            f"{name}: before / after",
            lambda n, r=row: ratio(s(n, f"{r}.before"), s(n, f"{r}.after")),
        )
        for phase in ("before", "after"):
            add(
                f"{name}: {phase} at N / at N₀",
                lambda n, r=row, p=phase: ratio(s(n, f"{r}.{p}"), s(n0, f"{r}.{p}")),
            )
    add("compact: at N / at N₀", lambda n: ratio(s(n, "compact.after"), s(n0, "compact.after")))
    out += ["## Ratios", "", table(head, rows), ""]

    # peak memory of the CLI runs
    rss_lines = [
        (label, key)
        for label, key in lines
        if any(get(n, key) is not None and get(n, key).rss_mib for n in ns)
    ]
    if rss_lines:
        rows = [
            [label]
            + [
                f"{get(n, key).rss_mib:,.0f}" if get(n, key) and get(n, key).rss_mib else "—"
                for n in ns
            ]
            for label, key in rss_lines
        ]
        out += ["## Peak RSS of the CLI runs (MiB)", "", table(head, rows), ""]

    # answers
    rows = []
    for label, key in lines:
        vals = [get(n, key) for n in ns]
        if any(v is not None and v.value is not None for v in vals):
            rows.append([label] + [answer_text(v) for v in vals])
    if rows:
        out += ["## Answers (what each measured call returned)", "", table(head, rows), ""]

    problems = [
        f"- N = {n:,}, {key}: {cell.problem}"
        for n in ns
        for key, cell in R[n].items()
        if cell.problem
    ]
    if problems:
        out += ["## Problems", "", *problems, ""]
    return "\n".join(out)


def answer_text(cell: Cell | None) -> str:
    if cell is None or cell.value is None:
        return "—"
    v = cell.value
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):  # compaction
        return f"{v[1]:.1f} s inside" if v[1] is not None else v[0][:60]
    if isinstance(v, list):
        return "; ".join(", ".join(str(x) for x in r) for r in v)[:80]
    return str(v)


def nproc() -> str:
    try:
        return subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu ?"


def mem_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return float("nan")


def pkg_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def git_state() -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        dirty = [d for d in dirty if d.strip()]
        return f"{head[:70]}" + (f" + {len(dirty)} modified file(s)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


# --- main ---------------------------------------------------------------------------------------
def add_seed_arguments(parser: argparse.ArgumentParser, work: str, work_help: str) -> None:
    """The seed store's options and the scratch folder (`--work`, default /tmp/`work`), shared
    with benchmarks/bench_view.py, which clones its stores with `build_seed`/`build_store`."""
    parser.add_argument(
        "--seed-store",
        default=None,
        metavar="PATH",
        help="clone the shards of this store (e.g. a `make demo` store) instead of building one",
    )
    parser.add_argument("--seed-env", default="sokoban")
    parser.add_argument("--seed-policy", default="tiny")
    parser.add_argument("--seed-groups", type=int, default=32)
    parser.add_argument("--seed-group-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1, help="the seed actor's --seed")
    parser.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / work),
        metavar="DIR",
        help=f"scratch folder: {work_help}",
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="Rows for --only: " + ", ".join(f"{k} ({v})" for k, v in ROWS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--groups",
        type=int,
        nargs="+",
        default=[1000, 16000, 64000],
        metavar="N",
        help="store sizes in groups (default: 1000 16000 64000)",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per measurement; the best counts (default 3)"
    )
    parser.add_argument(
        "--skip-before-above",
        type=int,
        default=None,
        metavar="N",
        help="skip the before-compaction CLI rows (sql, advantages) of stores above N groups",
    )
    parser.add_argument(
        "--only",
        default=",".join(ROWS),
        metavar="ROWS",
        help="comma-separated rows to measure (default: all); see below",
    )
    add_seed_arguments(
        parser, "gagpo-store-scale", "seed, stores, floors, HOME and TMPDIR of the CLIs"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep each N's store and floor (default: removed after)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="S",
        help="kill a CLI run after S seconds (default 3600)",
    )
    parser.add_argument(
        "--out", default=None, metavar="FILE", help="also write the Markdown report here"
    )
    parser.add_argument(
        "--json", default=None, metavar="FILE", help="also write the raw measurements here"
    )
    args = parser.parse_args(argv)
    args.only = [r.strip() for r in args.only.split(",") if r.strip()]
    unknown = [r for r in args.only if r not in ROWS]
    if unknown:
        parser.error(f"--only: unknown row(s) {', '.join(unknown)}; accepted: {', '.join(ROWS)}")
    if args.repeat < 1 or any(n < 1 for n in args.groups):
        parser.error("--repeat and --groups must be positive")
    args.groups = sorted(set(args.groups))
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    started = time.perf_counter()
    args = parse_args(argv)
    work = Path(args.work)
    (work / "home").mkdir(parents=True, exist_ok=True)
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HOME": str(work / "home"),
        "TMPDIR": str(work / "tmp"),
        "PYTHONUNBUFFERED": "1",
    }
    env.setdefault("GAGPO_CACHE", str(ROOT / ".cache" / "gagpo"))
    env.pop("GAGPO_STORE_RETRY_S", None)

    bench = Bench(args, env)
    seed_dir = Path(args.seed_store) if args.seed_store else build_seed(args, env)
    seed = read_seed(seed_dir)
    seed_groups = sum(len(s.groups) for s in seed)
    seed_rows = sum(s.table.num_rows for s in seed)
    bench.seed_note = (
        f"{seed_dir} ({len(seed)} shards, {seed_groups} groups, {seed_rows:,} steps; "
        f"{seed_rows / seed_groups:.0f} steps per group), cloned with fresh ids"
    )
    log(f"seed: {bench.seed_note}")
    bench.measure_startup()
    for n in args.groups:
        store, floor = work / f"store-{n}", work / f"floor-{n}.parquet"
        log(f"N={n}: cloning the seed into {store} and {floor}")
        built = build_store(seed, n, store, floor)
        bench.built[n] = built
        log(
            f"  {built.groups} groups, {built.rows:,} steps, {built.shards} shards "
            f"({built.shard_bytes / 2**20:.0f} MiB), floor {built.floor_bytes / 2**20:.0f} MiB, "
            f"in {fmt_s(built.seconds)}"
        )
        try:
            bench.measure(n, built, store, floor)
        finally:
            if not args.keep:
                shutil.rmtree(store, ignore_errors=True)
                floor.unlink(missing_ok=True)
        text = report(bench, argv, started)
        if args.out:  # after every N: a long run leaves what it measured so far
            Path(args.out).write_text(text + "\n")
    text = report(bench, argv, started)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        raw = {
            str(n): {
                k: {
                    "seconds": c.seconds,
                    "runs": c.runs,
                    "rss_mib": c.rss_mib,
                    "problem": c.problem,
                    "skipped": c.skipped,
                }
                for k, c in cells.items()
            }
            for n, cells in bench.results.items()
        }
        Path(args.json).write_text(json.dumps(raw, indent=1) + "\n")
    log(f"done in {fmt_s(time.perf_counter() - started)}")


if __name__ == "__main__":
    main()

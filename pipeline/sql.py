"""Read-only DuckDB views over a store, for inspecting credit assignment with SQL.

`open_store_db(store)` returns an in-memory DuckDB connection with these views:

    steps            one row per agent turn (the steps table of docs/design.md §3, schema
                     1.1; `won` of 1.0 shards derived, flagged by `won_derived`)
    advantages       every advantage table of the store, `estimator` = its tag
    estimators       one row per advantage tag: estimator name and JSON parameters
    step_returns     discounted return-to-go of every step at the connection's γ
    trajectories     one row per rollout: return, success (= won), length, policy version
    groups           one row per group: success rate, return spread, singleton states
    state_pools      one row per (estimator, group, state): visits, value proxy, spread
    policy_versions  one row per policy version: published, latest, what it generated
    learner_metrics  one row per learner update (empty but typed before the learner runs)
    learner_histograms  one row per (histogram, update, bin): staleness, behaviour weights …
    heldout          one row per evaluated policy version: success on the run's held-out tasks
                     (eval/heldout.parquet, `gagpo run` with [run] eval_groups; else empty)

Confinement works by never letting DuckDB touch a file system. The store's committed
files are listed here, in Python, and handed to DuckDB as Arrow datasets that pyarrow
scans (through fsspec for object stores); the connection itself is opened with
`enable_external_access = false` (no file functions, COPY, ATTACH, EXPORT, INSTALL or
extension loading), Python replacement scans off, and then `lock_configuration = true`
so that no query can switch any of it back. DuckDB refuses the rest itself; nothing
here inspects query text.

Bounds (`Limits`): each connection gets a memory limit and spills only into a private
temporary folder (mode 0700, removed by `close_store_db` or at exit), never into the
current directory or the store; each query gets a time limit, enforced by a timer that
calls `con.interrupt()` (DuckDB has no statement timeout). A result is fetched in
batches and stopped once it outgrows the memory limit. A query stopped by a limit is
one line naming the limit and its flag.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import posixpath
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.store import ADVANTAGES, EVAL, HELDOUT, LEARNER, POLICY, Store

# Same default as the advantage stage (docs/design.md §4); used only where no advantages exist.
DEFAULT_GAMMA = 0.95

ESTIMATOR = "estimator"

# --- learner metrics: learner/metrics/*.parquet, one row per update ------------------
# The columns the learner writes are the contract's (schemas/columns.py). A column a file lacks
# reads as NULL; the types of the newest file win where it has a column, and columns
# beyond these are passed through.
LEARNER_METRICS_DIR = "metrics"
LEARNER_HISTOGRAMS = "histograms.zarr"
UPDATE = "update"
VERSION = "version"
STALENESS_MEAN = "staleness_mean"
STALENESS_MAX = "staleness_max"
BEHAVIOR_WEIGHT_MEAN = "behavior_weight_mean"
BEHAVIOR_WEIGHT_MAX = "behavior_weight_max"

LEARNER_METRICS_COLUMNS = C.LEARNER_METRICS_COLUMNS
LEARNER_METRICS_SCHEMA = C.LEARNER_METRICS_SCHEMA
# learner/histograms.zarr/<name>: int64 [updates, bins], bin edges in attrs["edges"]
# (bins + 1 edges, or one label per bin); one row per (name, update, bin) here.
LEARNER_HISTOGRAMS_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string()),
        pa.field(UPDATE, pa.int64()),
        pa.field("bin", pa.int64()),
        pa.field("low", pa.float64()),
        pa.field("high", pa.float64()),
        pa.field("count", pa.int64()),
    ]
)

ADVANTAGES_VIEW_SCHEMA = pa.schema([pa.field(ESTIMATOR, pa.string()), *C.ADVANTAGES_SCHEMA])
ESTIMATORS_SCHEMA = pa.schema(
    [
        pa.field(ESTIMATOR, pa.string()),
        pa.field("name", pa.string()),
        pa.field("params", pa.string()),
        pa.field("shards", pa.int64()),
    ]
)
_POLICY_SCHEMA = pa.schema(
    [
        pa.field("version", pa.int64()),
        pa.field("published", pa.bool_()),
        pa.field("is_latest", pa.bool_()),
    ]
)

# Settings fixed before any user query runs; `lock_configuration` comes last.
_LOCKED_SETTINGS = {
    "enable_external_access": False,
    "python_enable_replacements": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "allow_unsigned_extensions": False,
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def memory_bytes(text: str) -> int:
    """Bytes of a size such as 512MB, 4GB or 2GiB (DuckDB's units: KB = 1000 B, KiB = 1024 B)."""
    match = _SIZE.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise GagpoError(
            f"memory limit {text!r} is not a size; accepted: a positive size such as 512MB, "
            "4GB or 2GiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def default_memory_limit() -> str:
    """Half the machine's memory, at most 4 GiB: a query never takes the machine."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2**30
    return f"{min(4 * 2**30, total // 2) // 2**20}MiB"


@dataclass(frozen=True)
class Limits:
    """Per-query bounds of `gagpo sql` / `gagpo report` (flags --timeout, --memory-limit)."""

    timeout_s: float = 300.0  # wall-clock seconds per query; 0: none
    memory_limit: str = ""  # DuckDB size; "" = default_memory_limit()

    def memory(self) -> str:
        return self.memory_limit or default_memory_limit()


# name -> what one row is; shown by `.views` in the interactive prompt and in docs.
VIEWS = {
    "steps": "one agent turn (steps table, schema v1.1; won_derived: a v1.0 row)",
    "advantages": "one step under one estimator tag (advantages table + estimator)",
    "estimators": "one advantage tag: estimator name, JSON parameters, shard files",
    "step_returns": "one step: discounted return-to-go at the session's gamma",
    "trajectories": "one rollout: return, success (= won), length, policy version",
    "groups": "one group: success rate, return spread, singleton states",
    "state_pools": "one (estimator, group, state) pool: visits, value proxy, spread",
    "policy_versions": "one policy version: published, is_latest, what it generated",
    "learner_metrics": "one learner update: loss, KL, clipping, behaviour weights",
    "learner_histograms": "one bin of one learner histogram at one update",
    "heldout": "one evaluated policy version: success on the same held-out tasks",
}


_TEMP_DIRS: dict[int, str] = {}  # id(connection) → its private spill folder


def open_store_db(
    store: Store | str, *, gamma: float = DEFAULT_GAMMA, limits: Limits | None = None
) -> duckdb.DuckDBPyConnection:
    """An in-memory, locked-down DuckDB connection with the inspection views over `store`.

    `gamma` is the discount of `step_returns` and of the value proxies of groups that
    have no stored advantages yet. `limits.memory_limit` bounds the connection; close it
    with `close_store_db` to remove its spill folder at once.
    """
    limits = limits or Limits()
    if not (isinstance(gamma, int | float) and 0.0 <= gamma <= 1.0):
        raise GagpoError(f"gamma={gamma!r} is out of range; accepted: a number in [0, 1]")
    store = store if isinstance(store, Store) else Store(store)
    if not store.fs.exists(store.root):
        raise GagpoError(f"store {store.url!r} does not exist; accepted: an existing store root")
    if store.fs.isfile(store.root):
        raise GagpoError(f"store {store.url!r} is a file; accepted: a store root folder or URL")
    memory_limit = limits.memory()
    memory_bytes(memory_limit)  # a clear line for a bad size, before DuckDB sees it
    filesystem = _arrow_filesystem(store)

    spill = tempfile.mkdtemp(prefix="gagpo-sql-")  # 0700: private to this user
    config = dict(_LOCKED_SETTINGS, memory_limit=memory_limit, temp_directory=spill)
    try:
        con = duckdb.connect(":memory:", config=config)
    except duckdb.Error as exc:
        shutil.rmtree(spill, ignore_errors=True)
        raise GagpoError(f"cannot open DuckDB ({_first_line(exc)})") from None
    _TEMP_DIRS[id(con)] = spill
    sources = {
        "steps": _parquet_source(
            filesystem, [ref.path for ref in store.list_shards()], C.STEPS_SCHEMA
        ),
        "advantages": _advantages_source(store, filesystem),
        "estimators": _estimators_table(store),
        "policy": _policy_table(store),
        "learner_metrics": _learner_metrics_source(store, filesystem),
        "learner_histograms": _learner_histograms_table(store),
        "heldout": _parquet_source(
            filesystem, _committed(store, store.path(EVAL, HELDOUT)), C.HELDOUT_SCHEMA
        ),
    }
    for name, source in sources.items():
        con.register(f"_gagpo_{name}", source)
    for statement in _view_statements(gamma):
        con.execute(statement)
    con.execute("SET lock_configuration = true")
    return con


def close_store_db(con: duckdb.DuckDBPyConnection) -> None:
    """Close the connection and remove its spill folder."""
    con.close()
    spill = _TEMP_DIRS.pop(id(con), None)
    if spill:
        shutil.rmtree(spill, ignore_errors=True)


@atexit.register
def _remove_spill_folders() -> None:  # connections closed without close_store_db
    for spill in _TEMP_DIRS.values():
        shutil.rmtree(spill, ignore_errors=True)


# What a stopped query raises: DuckDB's own, or Arrow's while a result is streamed.
_STOPPED = (duckdb.InterruptException, duckdb.OutOfMemoryException, OSError, pa.ArrowException)


@contextmanager
def time_limit(cons, timeout_s: float, memory_limit: str = "") -> Iterator[None]:
    """Interrupt the queries of `cons` (a connection or several) still running after
    `timeout_s` seconds (0: no limit); a query stopped by it, or by the memory limit,
    raises a GagpoError of one line."""
    cons = cons if isinstance(cons, list | tuple) else [cons]
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        for con in cons:
            con.interrupt()

    timer = threading.Timer(timeout_s, interrupt) if timeout_s and timeout_s > 0 else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    except _STOPPED as exc:
        if fired.is_set():
            raise GagpoError(
                f"query stopped: it ran longer than the time limit of {timeout_s:g}s; accepted: "
                "a narrower query, or a larger --timeout SECONDS (0: none)"
            ) from None
        if isinstance(exc, duckdb.OutOfMemoryException) or "Out of Memory" in str(exc):
            raise GagpoError(
                f"query stopped: it needs more than the memory limit {memory_limit}; accepted: a "
                "narrower query (filter, aggregate, LIMIT), or a larger --memory-limit such as 8GB"
            ) from None
        raise
    finally:
        if timer is not None:
            timer.cancel()


def run_query(con: duckdb.DuckDBPyConnection, query: str, limits: Limits | None = None) -> pa.Table:
    """Run `query` (one or more statements) and return the last result as Arrow, within
    `limits` (time; the result's size against the memory limit).

    DuckDB's refusals, query errors and stops by a limit become a GagpoError of one line.
    """
    limits = limits or Limits()
    try:
        with time_limit(con, limits.timeout_s, limits.memory()):
            relation = con.sql(query)
            if relation is None:  # a statement without a result (SET, CREATE TABLE …)
                return pa.table({})
            return _fetch(relation, memory_bytes(limits.memory()))
    except (duckdb.PermissionException, duckdb.InvalidInputException) as exc:
        reason = _first_line(exc)
        if isinstance(exc, duckdb.PermissionException) or "configuration has been locked" in reason:
            raise GagpoError(
                "query refused: gagpo sql is read-only and confined to the store "
                f"(query the views instead; DuckDB: {reason})"
            ) from None
        raise GagpoError(f"query failed: {reason}") from None
    except duckdb.Error as exc:
        raise GagpoError(f"query failed: {_first_line(exc)}") from None


def _fetch(relation, max_bytes: int) -> pa.Table:
    """The result in batches, stopped once it holds more than `max_bytes`."""
    reader = relation.to_arrow_reader(64 * 1024)
    batches, size = [], 0
    for batch in reader:
        size += batch.nbytes
        if size > max_bytes:
            raise GagpoError(
                f"query stopped: its result exceeds the memory limit ({max_bytes / 2**20:.0f} MiB); "
                "accepted: a narrower query (aggregate, LIMIT), or a larger --memory-limit"
            )
        batches.append(batch)
    return pa.Table.from_batches(batches, schema=reader.schema)


def view_columns(con: duckdb.DuckDBPyConnection, view: str) -> list[tuple[str, str]]:
    """(column, type) pairs of a view."""
    rows = con.execute(
        "SELECT column_name, data_type FROM information_schema.columns "
        "WHERE table_name = ? ORDER BY ordinal_position",
        [view],
    ).fetchall()
    return [(name, dtype) for name, dtype in rows]


# --- sources: what DuckDB may read, listed here --------------------------------------
def _arrow_filesystem(store: Store):
    import pyarrow.fs as pafs

    if store.is_local:
        return pafs.LocalFileSystem()
    return pafs.PyFileSystem(pafs.FSSpecHandler(store.fs))


def _committed(store: Store, pattern: str) -> list[str]:
    """Files matching `pattern`, without temporaries (hidden names, in any folder level)."""

    def hidden(path: str) -> bool:
        return any(part.startswith(".") for part in posixpath.relpath(path, store.root).split("/"))

    return sorted(path for path in store.fs.glob(pattern) if not hidden(path))


def _parquet_source(filesystem, paths: list[str], schema: pa.Schema, **options):
    """A lazily scanned dataset of `paths` read as `schema`; an empty typed table if none."""
    if not paths:
        return schema.empty_table()
    return ds.dataset(paths, schema=schema, format="parquet", filesystem=filesystem, **options)


def _advantage_files(store: Store) -> list[str]:
    return _committed(store, store.path(ADVANTAGES, "*", "*.parquet"))


def _advantages_source(store: Store, filesystem):
    """All advantage tables; the tag folder becomes the `estimator` column."""
    partitioning = ds.DirectoryPartitioning(
        pa.schema([pa.field(ESTIMATOR, pa.string())]), segment_encoding="none"
    )
    return _parquet_source(
        filesystem,
        _advantage_files(store),
        ADVANTAGES_VIEW_SCHEMA,
        partitioning=partitioning,
        partition_base_dir=store.path(ADVANTAGES),
    )


def _estimators_table(store: Store) -> pa.Table:
    """Per tag: name and parameters from the file metadata of its first file."""
    by_tag: dict[str, list[str]] = {}
    for path in _advantage_files(store):
        by_tag.setdefault(posixpath.basename(posixpath.dirname(path)), []).append(path)
    rows = []
    for tag, paths in sorted(by_tag.items()):
        with store.fs.open(paths[0], "rb") as handle:
            metadata = pq.read_schema(handle).metadata or {}
        rows.append(
            {
                ESTIMATOR: tag,
                "name": _decode(metadata.get(C.META_ESTIMATOR)),
                "params": _decode(metadata.get(C.META_ESTIMATOR_PARAMS)),
                "shards": len(paths),
            }
        )
    return pa.Table.from_pylist(rows, schema=ESTIMATORS_SCHEMA)


def _policy_table(store: Store) -> pa.Table:
    """Versions with a folder under policy/, and the one LATEST names.

    A folder is published only once LATEST has reached its version (docs/design.md §3:
    a version is complete before LATEST points at it).
    """
    latest = store.latest_version()
    versions = set() if latest is None else {latest}
    for path in store.fs.glob(store.path(POLICY, "v*")):
        digits = posixpath.basename(path)[1:]
        if digits.isdigit() and store.fs.isdir(path):
            versions.add(int(digits))
    rows = [
        {
            "version": v,
            "published": latest is not None and v <= latest,
            "is_latest": v == latest,
        }
        for v in sorted(versions)
    ]
    return pa.Table.from_pylist(rows, schema=_POLICY_SCHEMA)


def _learner_metrics_source(store: Store, filesystem):
    paths = _committed(store, store.path(LEARNER, LEARNER_METRICS_DIR, "*.parquet"))
    schema = LEARNER_METRICS_SCHEMA
    if paths:
        with store.fs.open(paths[-1], "rb") as handle:
            newest = pq.read_schema(handle)
        usable = {f.name: f.with_nullable(True) for f in newest if not pa.types.is_null(f.type)}
        fields = [usable.get(f.name, f) for f in LEARNER_METRICS_SCHEMA]
        fields += [f for name, f in usable.items() if name not in LEARNER_METRICS_SCHEMA.names]
        schema = pa.schema(fields)
    return _parquet_source(filesystem, paths, schema)


def _learner_histograms_table(store: Store) -> pa.Table:
    """The learner's per-update histograms, read here (zarr) and handed over as rows."""
    path = store.path(LEARNER, LEARNER_HISTOGRAMS)
    if not store.fs.exists(path):
        return LEARNER_HISTOGRAMS_SCHEMA.empty_table()
    from gagpo.schemas.extras import missing

    if missing("report"):  # the core install has no zarr: the view stays empty, and says why
        print(
            "gagpo sql: learner_histograms is empty: reading histograms.zarr needs the "
            "'report' extra: pip install 'gagpo[report]'",
            file=sys.stderr,
        )
        return LEARNER_HISTOGRAMS_SCHEMA.empty_table()
    import numpy as np
    import zarr

    if store.is_local:
        group = zarr.open_group(path, mode="r")
    else:
        from zarr.storage import FsspecStore

        url = store.url.rstrip("/") + f"/{LEARNER}/{LEARNER_HISTOGRAMS}"
        group = zarr.open_group(FsspecStore.from_url(url, read_only=True), mode="r")
    tables = []
    for name in sorted(group.array_keys()):
        array = group[name]
        counts = np.asarray(array[...], dtype=np.int64)
        if counts.ndim != 2 or counts.size == 0:
            continue
        updates, bins = counts.shape
        edges = [float(e) for e in array.attrs.get("edges", [])]
        if len(edges) == bins + 1:
            low, high = edges[:-1], edges[1:]
        elif len(edges) == bins:  # one label per bin
            low, high = edges, [None] * bins
        else:
            low, high = [None] * bins, [None] * bins
        tables.append(
            pa.table(
                {
                    "name": pa.array([name] * counts.size, pa.string()),
                    UPDATE: np.repeat(np.arange(1, updates + 1, dtype=np.int64), bins),
                    "bin": np.tile(np.arange(bins, dtype=np.int64), updates),
                    "low": pa.array(low * updates, pa.float64()),
                    "high": pa.array(high * updates, pa.float64()),
                    "count": counts.ravel(),
                },
                schema=LEARNER_HISTOGRAMS_SCHEMA,
            )
        )
    return pa.concat_tables(tables) if tables else LEARNER_HISTOGRAMS_SCHEMA.empty_table()


def _decode(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "replace")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- views ---------------------------------------------------------------------------
def _return_block(gamma: float) -> int:
    """Block length B for the return-to-go window, with γ^B ≈ 1e-100.

    Within a block, powers γ^(k - block start) stay above 1e-100 and their inverses
    below 1e100, so nothing underflows however long the rollout; a term one whole
    block ahead or more is weighted by at most γ^B relative to the current reward and
    dropped, which is below double precision.
    """
    if gamma >= 1.0:
        return 2**31 - 1
    if gamma <= 0.0:
        return 1
    return max(1, math.floor(230.0 / -math.log(gamma)))


def _view_statements(gamma: float) -> Iterable[str]:
    g = f"{float(gamma)!r}::DOUBLE"
    block = _return_block(gamma)
    # Schema 1.0 shards have no `won` (the scan reads it as NULL): derive it as success
    # was read then, and say so in `won_derived` (schemas/columns.py, docs/inspect.md).
    yield f"""
    CREATE VIEW steps AS
    SELECT * REPLACE (coalesce({C.WON}, {C.WON_FROM_V1_0_SQL}) AS {C.WON}),
           {C.WON} IS NULL AS won_derived
    FROM _gagpo_steps
    """
    yield (
        "CREATE VIEW advantages AS "
        f"SELECT {ESTIMATOR}, * EXCLUDE ({ESTIMATOR}) FROM _gagpo_advantages"
    )
    yield "CREATE VIEW estimators AS SELECT * FROM _gagpo_estimators"
    yield "CREATE VIEW learner_metrics AS SELECT * FROM _gagpo_learner_metrics"
    yield "CREATE VIEW learner_histograms AS SELECT * FROM _gagpo_learner_histograms"
    yield "CREATE VIEW heldout AS SELECT * FROM _gagpo_heldout ORDER BY policy_version"
    # G_t = Σ_{k≥t} γ^(k−t) r_k, as a suffix sum within fixed blocks of B steps plus the
    # next block's total (see _return_block): window sums only, exact for long rollouts.
    yield f"""
    CREATE VIEW step_returns AS
    WITH blocked AS (
        SELECT group_id, traj_id, step, state_key, reward::DOUBLE AS reward,
               step // {block} AS block, step % {block} AS pos
        FROM steps
    ), suffix AS (
        SELECT *, sum(reward * pow({g}, pos)) OVER (
            PARTITION BY traj_id, block ORDER BY step
            ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING) AS in_block
        FROM blocked
    ), block_totals AS (
        SELECT traj_id, block, sum(reward * pow({g}, pos)) AS total
        FROM blocked GROUP BY traj_id, block
    )
    SELECT s.group_id, s.traj_id, s.step, s.state_key,
           pow({g}, -s.pos) * (s.in_block + pow({g}, {block}) * coalesce(b.total, 0))
               AS "return",
           {g} AS gamma
    FROM suffix s
    LEFT JOIN block_totals b ON b.traj_id = s.traj_id AND b.block = s.block + 1
    """
    yield """
    CREATE VIEW trajectories AS
    SELECT run_id, shard_id, group_id, traj_id,
           any_value(env) AS env,
           any_value(task_id) AS task_id,
           min(policy_version) AS policy_version,
           count(*) AS length,
           sum(reward::DOUBLE) AS "return",
           arg_max(won, step) AS success,
           bool_or(won_derived) AS won_derived,
           arg_max(truncated, step) AS truncated,
           count(*) FILTER (WHERE NOT action_valid) AS invalid_actions,
           min(created_at) AS started_at,
           max(created_at) AS ended_at
    FROM steps
    GROUP BY run_id, shard_id, group_id, traj_id
    """
    yield """
    CREATE VIEW groups AS
    WITH pools AS (
        SELECT group_id, state_key, count(*) AS visits FROM steps GROUP BY group_id, state_key
    ), pool_counts AS (
        SELECT group_id, count(*) AS states,
               count(*) FILTER (WHERE visits = 1) AS singleton_states
        FROM pools GROUP BY group_id
    ), rollouts AS (
        SELECT group_id,
               any_value(run_id) AS run_id,
               any_value(shard_id) AS shard_id,
               any_value(env) AS env,
               any_value(task_id) AS task_id,
               min(policy_version) AS policy_version,
               count(*) AS rollouts,
               sum(length) AS steps,
               avg(success::DOUBLE) AS success_rate,
               avg("return") AS mean_return,
               stddev_pop("return") AS std_return,
               min("return") AS min_return,
               max("return") AS max_return,
               min(started_at) AS started_at
        FROM trajectories GROUP BY group_id
    )
    SELECT r.*, p.states, p.singleton_states,
           p.singleton_states / r.steps AS singleton_rate
    FROM rollouts r JOIN pool_counts p USING (group_id)
    """
    # Value proxies from the stored advantages where a group has them (one row per
    # estimator); otherwise from step_returns at this session's γ, with estimator NULL.
    yield """
    CREATE VIEW state_pools AS
    WITH pooled AS (
        SELECT estimator, group_id, traj_id, state_key, "return" FROM advantages
        UNION ALL
        SELECT NULL::VARCHAR AS estimator, r.group_id, r.traj_id, r.state_key, r."return"
        FROM step_returns r
        ANTI JOIN (SELECT DISTINCT group_id FROM advantages) a USING (group_id)
    )
    SELECT estimator, group_id, state_key,
           count(*) AS visits,
           count(DISTINCT traj_id) AS trajectories,
           avg("return") AS value_proxy,
           stddev_pop("return") AS return_std,
           min("return") AS return_min,
           max("return") AS return_max
    FROM pooled
    GROUP BY estimator, group_id, state_key
    """
    yield """
    CREATE VIEW policy_versions AS
    WITH generated AS (
        SELECT policy_version AS version,
               sum(length) AS steps,
               count(*) AS trajectories,
               count(DISTINCT group_id) AS groups,
               avg(success::DOUBLE) AS success_rate,
               avg("return") AS mean_return,
               min(started_at) AS first_step_at,
               max(ended_at) AS last_step_at
        FROM trajectories GROUP BY policy_version
    )
    SELECT coalesce(p.version, g.version) AS version,
           coalesce(p.published, false) AS published,
           coalesce(p.is_latest, false) AS is_latest,
           coalesce(g.steps, 0)::BIGINT AS steps,
           coalesce(g.trajectories, 0) AS trajectories,
           coalesce(g.groups, 0) AS groups,
           g.success_rate, g.mean_return, g.first_step_at, g.last_step_at
    FROM _gagpo_policy p FULL OUTER JOIN generated g ON p.version = g.version
    ORDER BY version
    """


def describe_views(con: duckdb.DuckDBPyConnection) -> str:
    """One block per view: what a row is and its columns, for the interactive prompt."""
    lines = []
    for view, meaning in VIEWS.items():
        columns = ", ".join(f"{name} {dtype.lower()}" for name, dtype in view_columns(con, view))
        lines.append(f"{view}: {meaning}\n    {columns}")
    return "\n".join(lines)


def estimator_params(con: duckdb.DuckDBPyConnection) -> dict[str, dict]:
    """Parameters of each advantage tag, parsed from its file metadata."""
    out = {}
    for tag, params in con.execute("SELECT estimator, params FROM estimators").fetchall():
        try:
            out[tag] = json.loads(params) if params else {}
        except json.JSONDecodeError:
            out[tag] = {"raw": params}
    return out

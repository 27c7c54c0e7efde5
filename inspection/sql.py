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
    policy_versions  one row per policy version: published (LATEST reached it), stored
                     (its folder is complete now), pruned, is_latest, what it generated
    learner_metrics  one row per learner update (empty but typed before the learner runs)
    learner_histograms  one row per (histogram, update, bin): staleness, behaviour weights …
    heldout          one row per evaluated policy version: success on the run's held-out tasks
                     (eval/heldout.parquet, `gagpo run` with [run] eval_groups; else empty)

Confinement works by letting DuckDB touch no file but those listed here, in Python. The
store's committed files are handed to DuckDB as Arrow datasets that pyarrow scans
(through fsspec for object stores), except the archive's segments on a local store,
which DuckDB reads itself (several times faster on a long run's history) through a
registered file system that can only read them (inspection/sql_segments.py): their
`gagposegment://` URLs, and nothing else, are its `allowed_paths`, since a path DuckDB
may read it may also write. The connection runs with `enable_external_access = false`
(no other file, no COPY, ATTACH, EXPORT, INSTALL or extension loading), Python
replacement scans off, and then `lock_configuration = true` so that no query can switch
any of it back. Statements that name files or databases (ATTACH, DETACH, COPY, EXPORT,
LOAD, INSTALL) and prepared ones (PREPARE, EXECUTE) are refused before DuckDB runs them,
as typed by DuckDB's own parser, EXPLAIN's statement included; DuckDB refuses the rest
itself.

Bounds (`Limits`): each connection gets a memory limit and spills only into a private
temporary folder (mode 0700, removed by `close_store_db` or at exit), never into the
current directory or the store; each query gets a time limit, enforced by a timer that
calls `con.interrupt()` (DuckDB has no statement timeout). A result is fetched in
batches and stopped once it outgrows the memory limit. A query stopped by a limit is
one line naming the limit and its flag.

This module is the connection and its limits; what DuckDB may read is listed in
inspection/sql_sources.py, and the views' SQL is inspection/sql_views.py.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from gagpo.inspection import sql_sources as src
from gagpo.inspection.arguments import DEFAULT_GAMMA, DEFAULT_TIMEOUT_S
from gagpo.inspection.sql_segments import ReadOnlySegments, segment_url
from gagpo.inspection.sql_views import VIEWS, view_statements
from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError
from gagpo.storage.archive import is_missing_file
from gagpo.storage.resolving import Tries
from gagpo.storage.store import Store

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
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


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

    timeout_s: float = DEFAULT_TIMEOUT_S  # wall-clock seconds per query; 0: none
    memory_limit: str = ""  # DuckDB size; "" = default_memory_limit()

    def memory(self) -> str:
        return self.memory_limit or default_memory_limit()


_TEMP_DIRS: dict[int, str] = {}  # id(connection) → its private spill folder
_SEGMENTS: dict[int, list[str]] = {}  # id(connection) → the segments DuckDB reads itself
_REGISTERED: dict[int, dict] = {}  # id(connection) → its Arrow sources, by registered name


def open_store_db(
    store: Store | str,
    *,
    gamma: float = DEFAULT_GAMMA,
    limits: Limits | None = None,
    as_of_update: int | None = None,
) -> duckdb.DuckDBPyConnection:
    """An in-memory, locked-down DuckDB connection with the inspection views over `store`.

    `gamma` is the discount of `step_returns` and of the value proxies of groups that
    have no stored advantages yet. `limits.memory_limit` bounds the connection; close it
    with `close_store_db` to remove its spill folder at once.
    """
    limits = limits or Limits()
    if not (isinstance(gamma, int | float) and 0.0 <= gamma <= 1.0):
        raise GagpoError(f"gamma={gamma!r} is out of range; accepted: a number in [0, 1]")
    store = check_root(store)
    memory_limit = limits.memory()
    memory_bytes(memory_limit)  # a clear line for a bad size, before DuckDB sees it
    filesystem = src.arrow_filesystem(store)

    # archive and inbox, each group once, as of one generation (storage/archive.py)
    step = src.step_sources(store, filesystem)
    segments = step.segments  # read by DuckDB itself, allowed by path
    spill = tempfile.mkdtemp(prefix="gagpo-sql-")  # 0700: private to this user
    # allowed_paths can be set only while external access is on: then it goes off
    config = dict(_LOCKED_SETTINGS, memory_limit=memory_limit, temp_directory=spill)
    config["enable_external_access"] = bool(segments)
    try:
        con = duckdb.connect(":memory:", config=config)
        if segments:  # read through a file system without writes (inspection/sql_segments.py)
            con.register_filesystem(ReadOnlySegments(segments))
            con.execute(f"SET allowed_paths = {_sql_list([segment_url(p) for p in segments])}")
            con.execute("SET enable_external_access = false")
    except duckdb.Error as exc:
        shutil.rmtree(spill, ignore_errors=True)
        raise GagpoError(f"cannot open DuckDB ({_first_line(exc)})") from None
    _TEMP_DIRS[id(con)] = spill
    _SEGMENTS[id(con)] = segments or []
    sources = {
        "steps": step.steps,
        "advantages": step.advantages,
        "estimators": step.estimators,
        "policy": src.policy_table(store),
        "policy_loads": src.policy_loads_source(store, filesystem),
        "learner_metrics": src.learner_metrics_source(store, filesystem),
        "learner_histograms": src.learner_histograms_table(store),
        "heldout": src.parquet_source(
            filesystem,
            src.readable(store, src.committed(store, layout.heldout(store.root)), None, "heldout"),
            C.HELDOUT_SCHEMA,
        ),
    }
    as_of = _as_of_filters(store, as_of_update)
    registered = {"_gagpo_as_of_groups": as_of_groups(store, as_of_update)} if as_of else {}
    try:
        _REGISTERED[id(con)] = _create_views(con, sources, segments, as_of, gamma, registered)
    except duckdb.Error:
        close_store_db(con)
        gone = _gone(segments or [])
        if gone is not None:
            raise gone from None
        raise
    return con


def _create_views(
    con,
    sources: dict,
    segments: list[str] | None,
    as_of: dict[str, str],
    gamma: float,
    registered: dict,
) -> dict:
    """The views over `sources`; returns what was registered on `con` (with `registered`,
    registered here first), by name, for `store_cursor`."""
    for name, table in registered.items():
        con.register(name, table)
    for name, source in sources.items():
        table = f"_gagpo_{name}_all" if name in as_of else f"_gagpo_{name}"
        if name == "steps" and segments:  # the archive by DuckDB, the inbox tail by Arrow
            registered["_gagpo_inbox"] = source
            con.register("_gagpo_inbox", source)
            urls = [segment_url(p) for p in segments]
            con.execute(
                f"CREATE VIEW {table} AS SELECT * FROM read_parquet({_sql_list(urls)}) "
                "UNION ALL BY NAME SELECT * FROM _gagpo_inbox"
            )
        else:
            registered[table] = source
            con.register(table, source)
        if name in as_of:  # the store as it stood after that update: a filtering view
            con.execute(f"CREATE VIEW _gagpo_{name} AS SELECT * FROM {table} WHERE {as_of[name]}")
    for statement in view_statements(gamma):
        con.execute(statement)
    con.execute("SET lock_configuration = true")
    return registered


def store_cursor(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """Another connection to `con`'s database, with its views: the same locked settings,
    segments and listing of the store (inspection/library.py reads each frame through one).
    A connection runs one query at a time, so two results read together (a join of two
    Polars frames) need one each. The views are the database's, but the Arrow sources
    under them are registered per connection: they are registered on the cursor again."""
    cursor = con.cursor()
    for name, source in _REGISTERED.get(id(con), {}).items():
        cursor.register(name, source)
    return cursor


def _gone(segments: list[str]) -> GagpoError | None:
    """A segment DuckDB reads itself that a compaction merged away since it was listed:
    DuckDB then looks for a folder of that name, which it may not list, and refuses. Said
    as the missing file it is, so query_store resolves the store again."""
    gone = [p for p in segments if not os.path.exists(p)]
    if not gone:
        return None
    return GagpoError(f"query failed: No such file: {gone[0]} (a compaction merged it)")


def _raise_if_gone(con, exc: BaseException, reason: str) -> None:
    """A query that failed because a file it read vanished (a compaction removed it): said
    as a missing file, whichever DuckDB error carried it (an object store's is a Python
    FileNotFoundError below the first line), so query_store resolves the store again."""
    gone = _gone(_SEGMENTS.get(id(con), []))
    if gone is not None:
        raise gone from None
    if "FileNotFoundError" in str(exc):
        raise GagpoError(f"query failed: No such file ({reason})") from None


def _sql_list(paths: list[str]) -> str:
    """`paths` as a DuckDB list of string literals."""
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def as_of_groups(store: Store, update: int) -> pa.Table:
    from gagpo.storage.archive import groups_as_of

    return groups_as_of(store, update).select([C.GROUP_ID])


def _as_of_filters(store: Store, update: int | None) -> dict[str, str]:
    """Per source, the SQL condition of `--as-of-update U`: the groups the learner had
    consumed by update U (its ledger), the learner's rows up to U, versions up to U's."""
    if update is None:
        return {}
    groups = "group_id IN (SELECT group_id FROM _gagpo_as_of_groups)"
    return {
        "steps": groups,
        "advantages": groups,
        "learner_metrics": f'"update" <= {int(update)}',
        "policy": f"version <= {int(update)}",
    }


def close_store_db(con: duckdb.DuckDBPyConnection) -> None:
    """Close the connection and remove its spill folder."""
    con.close()
    _SEGMENTS.pop(id(con), None)
    _REGISTERED.pop(id(con), None)
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


def run_query(
    con: duckdb.DuckDBPyConnection,
    query: str,
    limits: Limits | None = None,
    params: list | dict | None = None,
) -> pa.Table:
    """Run `query` (one or more statements) and return the last result as Arrow, within
    `limits` (time; the result's size against the memory limit).

    `params` are the values of the query's `?` / `$name` placeholders, bound by DuckDB as
    a prepared statement's: a value never becomes SQL text. DuckDB's refusals, query
    errors and stops by a limit become a GagpoError of one line.
    """
    limits = limits or Limits()
    try:
        _refuse_statements(query)
        with time_limit(con, limits.timeout_s, limits.memory()):
            relation = con.sql(query, params=params)
            if relation is None:  # a statement without a result (SET, CREATE TABLE …)
                return pa.table({})
            return _fetch(relation, memory_bytes(limits.memory()))
    except (duckdb.PermissionException, duckdb.InvalidInputException) as exc:
        reason = _first_line(exc)
        _raise_if_gone(con, exc, reason)
        if isinstance(exc, duckdb.PermissionException) or "configuration has been locked" in reason:
            raise GagpoError(
                "query refused: gagpo sql is read-only and confined to the store "
                f"(query the views instead; DuckDB: {reason})"
            ) from None
        raise GagpoError(f"query failed: {reason}") from None
    except duckdb.Error as exc:
        reason = _first_line(exc)
        _raise_if_gone(con, exc, reason)
        if reason.startswith("PermissionError"):  # a write to a segment's read-only URL
            raise GagpoError(
                f"query refused: gagpo sql is read-only and confined to the store ({reason})"
            ) from None
        raise GagpoError(f"query failed: {reason}") from None


# Statements refused before DuckDB runs them, by the type DuckDB's own parser gives them:
# those that name files or databases (nothing may attach, copy over or export to a store's
# file), and prepared statements, whose body the parser does not show (PREPARE p AS COPY …
# is of type PREPARE): a query's values are bound by `params`, never by SQL PREPARE.
_REFUSED_STATEMENTS = frozenset(
    getattr(duckdb.StatementType, name)
    for name in (
        "ATTACH",
        "DETACH",
        "COPY",
        "COPY_DATABASE",
        "EXPORT",
        "LOAD",
        "EXTENSION",
        "PREPARE",
        "EXECUTE",
    )
    if hasattr(duckdb.StatementType, name)
)
# EXPLAIN's body is checked as a statement of its own: EXPLAIN ANALYZE runs it.
# Its head: EXPLAIN, then ANALYZE or options in parentheses, with spaces and comments
# anywhere between them (none inside the explained statement is touched).
_GAP = r"(?:\s|--[^\n]*(?:\n|$)|/\*.*?\*/)*"
_EXPLAIN = re.compile(
    rf"^{_GAP}explain\b{_GAP}(?:analy[sz]e\b{_GAP})?(?:\([^)]*\){_GAP})?",
    re.IGNORECASE | re.DOTALL,
)


def _refuse_statements(query: str) -> None:
    """Raise PermissionException for a statement of a refused type, explained ones
    included. DuckDB's own file settings (open_store_db) refuse writes whatever passes."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error:  # not SQL: DuckDB says why when it runs it
        return
    for statement in statements:
        try:
            kind = statement.type
        except ValueError:  # a kind this duckdb's Python API cannot name (UPDATE EXTENSIONS)
            raise duckdb.PermissionException("this kind of statement is not accepted") from None
        if kind in _REFUSED_STATEMENTS:
            raise duckdb.PermissionException(f"{kind.name} statements are not accepted")
        if kind == duckdb.StatementType.EXPLAIN:
            _refuse_statements(_explained(statement.query))


def _explained(text: str) -> str:
    """The statement an EXPLAIN statement explains; one this cannot find is refused."""
    match = _EXPLAIN.match(text)
    body = text[match.end() :] if match else ""
    try:
        if len(duckdb.extract_statements(body)) == 1:
            return body
    except duckdb.Error:
        pass
    raise duckdb.PermissionException("EXPLAIN of this statement is not accepted")


def check_root(store: Store | str) -> Store:
    """The store, once its root is known to be an existing folder (one line otherwise)."""
    store = store if isinstance(store, Store) else Store(store)
    if not store.fs.exists(store.root):
        raise GagpoError(f"store {store.url!r} does not exist; accepted: an existing store root")
    if store.fs.isfile(store.root):
        raise GagpoError(f"store {store.url!r} is a file; accepted: a store root folder or URL")
    return store


def query_store(
    store: Store | str,
    query: str,
    *,
    gamma: float = DEFAULT_GAMMA,
    limits: Limits | None = None,
    as_of_update: int | None = None,
) -> pa.Table:
    """`query` on a fresh connection over `store`. A file a compaction removed while the
    query ran (its groups are in a segment now) makes the query run again on the store as
    it stands, as every reader tries again (storage/resolving.py): a query never counts
    twice because a compaction committed, and fails only once compactions kept removing
    what it read for RESOLVE_DEADLINE_S and RESOLVE_ATTEMPTS runs."""
    store = check_root(store)  # a missing store is the user's, not a compaction's: no retry
    for _ in (tries := Tries()):
        con = None
        try:
            con = open_store_db(store, gamma=gamma, limits=limits, as_of_update=as_of_update)
            return run_query(con, query, limits)
        except (GagpoError, OSError, pa.ArrowException) as exc:
            if not is_missing_file(exc) or tries.exhausted():
                raise
        finally:
            if con is not None:
                close_store_db(con)
    raise AssertionError("unreachable")


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


def _first_line(exc: BaseException) -> str:
    """The line that says why: the first, or the last of a Python traceback (an error
    raised by a file system registered on the connection, inspection/sql_segments.py)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip(" ^~")]
    if not lines:
        return type(exc).__name__
    return lines[-1] if lines[0].startswith("Traceback") else lines[0]


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

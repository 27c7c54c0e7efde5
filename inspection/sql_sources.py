"""What the DuckDB connection of inspection/sql.py may read, listed here in Python.

Each source is an Arrow dataset of the store's committed files (scanned lazily by
pyarrow, through fsspec for object stores) or a small table built here; DuckDB itself
never touches a file system. The column contract of each is in schemas/columns.py or
below.
"""

from __future__ import annotations

import os
import posixpath
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError, ValidationError, first_line
from gagpo.schemas.validate import validate_footer
from gagpo.storage.archive import (
    Manifest,
    StepFiles,
    generation_of,
    read_manifest,
    step_files,
)
from gagpo.storage.registry import LOADS_SCHEMA, check_loads
from gagpo.storage.resolving import RESOLVE_DEADLINE_S, Tries
from gagpo.storage.store import Store

ESTIMATOR = "estimator"

# learner/histograms.zarr (schemas/columns.py): one row per (name, update, bin) here.
LEARNER_HISTOGRAMS_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string()),
        pa.field("update", pa.int64()),
        pa.field("bin", pa.int64()),
        pa.field("low", pa.float64()),
        pa.field("high", pa.float64()),
        pa.field("count", pa.int64()),
    ]
)

# pool_id: the step's pool under the tag's state grouping, in files written under a
# grouping other than exact (pipeline/grouping.py); null elsewhere (the pool is the state).
ADVANTAGES_VIEW_SCHEMA = pa.schema(
    [pa.field(ESTIMATOR, pa.string()), *C.ADVANTAGES_SCHEMA, pa.field("pool_id", pa.string())]
)
ESTIMATORS_SCHEMA = pa.schema(
    [
        pa.field(ESTIMATOR, pa.string()),
        pa.field("name", pa.string()),
        pa.field("params", pa.string()),
        pa.field("shards", pa.int64()),
    ]
)
POLICY_SCHEMA = pa.schema(
    [
        pa.field("version", pa.int64()),
        pa.field("published", pa.bool_()),
        pa.field("stored", pa.bool_()),
        pa.field("is_latest", pa.bool_()),
    ]
)


def arrow_filesystem(store: Store):
    if store.is_local:
        return pafs.LocalFileSystem()
    return pafs.PyFileSystem(pafs.FSSpecHandler(store.fs))


def committed(store: Store, pattern: str) -> list[str]:
    """Files matching `pattern`, without temporaries (hidden names, in any folder level),
    confined to the store (`inside`)."""

    def hidden(path: str) -> bool:
        return any(part.startswith(".") for part in posixpath.relpath(path, store.root).split("/"))

    return inside(store, sorted(path for path in store.glob(pattern) if not hidden(path)))


def inside(store: Store, paths: list[str]) -> list[str]:
    """The paths that are the store's own files: on a local store, none reached through a
    symlink below the root nor resolving outside it (a link in shards/ to a file elsewhere
    is never read). Object stores have no links: every listed key is under the root."""
    if not store.is_local:
        return paths
    root = os.path.realpath(store.root)
    kept = []
    for path in paths:
        expected = os.path.join(root, os.path.relpath(path, store.root))
        if os.path.realpath(path) == expected and not os.path.islink(path):
            kept.append(path)
    return kept


def readable(
    store: Store,
    paths: list[str],
    schema: pa.Schema | None,
    what: str,
    *,
    warnings: list[str] | None = None,
) -> list[str]:
    """The paths whose Parquet footer reads (and whose columns have `schema`'s types, when
    given). One unreadable file would fail every query of its view, so the others are
    skipped and named in one warning line on stderr (appended to `warnings` instead, when
    given); the views answer without them. A file that is no longer there is not
    unreadable: FileNotFoundError propagates (`_with_footers`)."""

    def check(found: pa.Schema) -> None:
        wrong = [
            f.name
            for f in schema or []
            if f.name in found.names and not found.field(f.name).type.equals(f.type)
        ]
        if wrong:
            raise ValueError(f"column {wrong[0]} has type {found.field(wrong[0]).type}")

    return _with_footers(store, paths, check, what, warnings=warnings)


def _with_footers(
    store: Store,
    paths: list[str],
    check,
    what: str,
    skipped=None,
    *,
    warnings: list[str] | None = None,
) -> list[str]:
    """The paths whose footer reads and passes `check(schema)`; the others named in one
    warning line (with `skipped`, reasons found before), printed, or appended to
    `warnings` when given.

    A file that vanished since it was listed raises FileNotFoundError, never a skip: a
    compaction removes the inbox shards it moved and the segment it merged once it has
    committed, and their groups are then in a segment that the caller's listing predates.
    Skipping them answered without those groups (issue 46); the caller resolves again."""
    kept, skipped = [], list(skipped or [])
    for path in paths:
        try:
            check(store.retrying(f"reading {path}", lambda p=path: _footer_schema(store, p)))
        except FileNotFoundError:  # local and object stores alike (fsspec)
            raise FileNotFoundError(f"No such file: {path} (moved by a compaction)") from None
        except (OSError, ValueError, pa.ArrowException, ValidationError) as exc:
            skipped.append(f"{posixpath.relpath(path, store.root)} ({first_line(exc, 120)})")
            continue
        kept.append(path)
    if skipped:
        shown = "; ".join(skipped[:5]) + (
            f"; and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        )
        line = (
            f"gagpo sql: warning: {what}: skipped {len(skipped)} unreadable file(s): {shown}; "
            "the views answer without them"
        )
        if warnings is None:
            print(line, file=sys.stderr)
        else:
            warnings.append(line)
    return kept


# The footers `step_sources` has read in this thread's current call, by path (None outside
# one): a pass after a compaction rereads none of them.
_FOOTERS: ContextVar[dict[str, pa.Schema] | None] = ContextVar("_FOOTERS", default=None)


@contextmanager
def _known_footers(footers: dict[str, pa.Schema]):
    token = _FOOTERS.set(footers)
    try:
        yield
    finally:
        _FOOTERS.reset(token)


def _footer_schema(store: Store, path: str) -> pa.Schema:
    known = _FOOTERS.get()
    if known is not None and path in known:
        return known[path]
    with store.fs.open(path, "rb") as handle:
        schema = pq.read_schema(handle)
    if known is not None:
        known[path] = schema
    return schema


# A path holding one of these is a pattern to DuckDB's read_parquet, never a file name.
_PATTERN_CHARACTERS = frozenset("*?[]{}")


def native_segments(
    store: Store, files: StepFiles, *, warnings: list[str] | None = None
) -> list[str] | None:
    """The archive's segments for DuckDB to read itself (`read_parquet`, allowed by path in
    inspection/sql.py), or None where the Arrow scan reads them: object stores (DuckDB has no
    fsspec) and paths DuckDB would take as a pattern. Segments are the bulk of a long run's
    steps and are written, validated, by the compactor alone; DuckDB's own reader counts
    from their footers and scans them in parallel, several times faster than a scan
    through Arrow (benchmarks/RESULTS.md, issue 29)."""
    paths = files.segment_paths(store)
    if not store.is_local or any(_PATTERN_CHARACTERS & set(p) for p in paths):
        return None
    return segment_files(store, files, warnings=warnings)


def segment_files(
    store: Store, files: StepFiles, *, warnings: list[str] | None = None
) -> list[str]:
    """The archive's segments that are the store's own (`inside`: no link) and whose footer
    passes the segment checks (schemas/validate.py `validate_footer`: schema version, the
    contract's columns and types). A bad segment would fail every query or give junk rows,
    so it is skipped and named in one warning line, as a bad inbox shard is; the views
    answer without it (docs/store.md, "Bad segments")."""
    paths = files.segment_paths(store)
    own = inside(store, paths)
    linked = [
        f"{posixpath.relpath(p, store.root)} (a symbolic link: never followed)"
        for p in paths
        if p not in own
    ]
    return _with_footers(store, own, validate_footer, "steps", linked, warnings=warnings)


def inbox_files(store: Store, files: StepFiles, *, warnings: list[str] | None = None) -> list[str]:
    """The inbox shards the archive does not hold that are the store's own and readable (a
    shard a learner has not quarantined yet may be neither)."""
    shards = inside(store, [ref.path for ref in files.shards])
    return readable(store, shards, C.STEPS_SCHEMA, "steps", warnings=warnings)


def steps_files(
    store: Store, files: StepFiles | None = None, *, warnings: list[str] | None = None
) -> list[str]:
    """The files of the store's steps (storage/archive.py, the one reader): the archive's
    segments, then the inbox tail (`inbox_files`). Segments are written by the compactor
    alone: their footers are not read here, so a query reads a few large files and no
    dataset discovery runs footer by footer over the history."""
    files = step_files(store) if files is None else files
    return segment_files(store, files, warnings=warnings) + inbox_files(
        store, files, warnings=warnings
    )


@dataclass(frozen=True)
class StepSources:
    """What the steps, advantages and estimators views read, as of one generation of the
    archive (`step_sources`)."""

    files: StepFiles
    segments: list[str] | None  # read by DuckDB itself (`native_segments`); None: in `steps`
    steps: object  # the Arrow source of the inbox tail (and of the segments, without native)
    advantages: object  # the Arrow source of the advantage tables of `files`
    estimators: pa.Table


def step_sources(
    store: Store, filesystem, *, deadline_s: float = RESOLVE_DEADLINE_S
) -> StepSources:
    """The steps views' files, resolved and opened as of one instant of the archive.

    A compaction that removes at once what it superseded (the inbox shards it moved, the
    segment it merged, their advantage tables) takes, right after its commit, files the
    resolution named: a footer read, or a dataset opened, then finds one missing, and an
    advantage listing made after the commit lacks the moved shards' tables. Either way,
    the store is resolved again (storage/archive.py `step_files`), until one pass ends
    with every file it names still there (`still_named`: the archive at the generation
    it started from, or the next when that one defers removal). A compaction that defers
    removal (storage/compaction.py) keeps those files until the next commit, so a pass
    that spans one whole compaction is kept at once. Unreadable files are skipped and
    named in one warning line (printed once, for the pass that is kept).

    A pass reads only the footers no earlier pass read (committed files never change), so
    a pass after a compaction costs what the compaction wrote, not the whole store
    (tests/test_reliability_round6_starvation.py). Passes are tried as every reader tries
    (storage/resolving.py: at least RESOLVE_ATTEMPTS and `deadline_s` seconds, random
    pauses doubling up to RESOLVE_PAUSE_S); then one line says why it stopped."""
    footers: dict[str, pa.Schema] = {}
    tries = Tries(deadline_s=deadline_s)
    for _ in tries:
        sources, warnings = _sources_pass(store, filesystem, footers)
        if sources is not None:
            for line in warnings:
                print(line, file=sys.stderr)
            return sources
    raise GagpoError(
        f"store {store.url}: compactions kept removing files while the views were opened "
        f"({tries.spent()}); accepted: try again when the store's compactions pause (a "
        "learner compacts at most once an update)"
    )


def _sources_pass(
    store: Store, filesystem, footers: dict[str, pa.Schema]
) -> tuple[StepSources | None, list[str]]:
    """One pass of `step_sources`: its sources and warning lines, or None when a
    compaction committed meanwhile. `footers`: the footers read so far, by path."""
    files = step_files(store)
    warnings: list[str] = []
    try:
        with _known_footers(footers):
            # a bad segment's warning is printed at once (rare: the compactor validated it)
            segments = native_segments(store, files)
            if segments is None:
                paths = steps_files(store, files, warnings=warnings)
            else:
                paths = inbox_files(store, files, warnings=warnings)
            advantages = _advantage_files(store, files, warnings=warnings)
        sources = StepSources(
            files,
            segments,
            parquet_source(filesystem, paths, C.STEPS_SCHEMA),
            advantages_source(store, filesystem, files, paths=advantages),
            estimators_table(store, files, paths=advantages),
        )
    except FileNotFoundError:  # a footer read, or a dataset opened (pyarrow says so)
        return None, []
    if not still_named(files.manifest, read_manifest(store)):
        return None, []
    return sources, warnings


def still_named(resolved: Manifest | None, now: Manifest | None) -> bool:
    """Whether every file a resolution at `resolved` named (and every table listed then)
    is still there with the archive at `now`: the same generation, or the next one when
    it defers removal (its compaction removed only what `resolved`'s predecessor named,
    storage/compaction.py `compact(defer_removal=True)`)."""
    start, end = generation_of(resolved), generation_of(now)
    return end == start or (end == start + 1 and now is not None and now.defers)


def parquet_source(filesystem, paths: list[str], schema: pa.Schema, **options):
    """A lazily scanned dataset of `paths` read as `schema`; an empty typed table if none.
    Through a Python file system (an object store's fsspec), its scans are serial
    (`SerialScanDataset`)."""
    if not paths:
        return schema.empty_table()
    dataset = ds.dataset(paths, schema=schema, format="parquet", filesystem=filesystem, **options)
    if not isinstance(filesystem, pafs.PyFileSystem):
        return dataset
    return SerialScanDataset(
        list(dataset.get_fragments()), dataset.schema, dataset.format, dataset.filesystem
    )


class SerialScanDataset(ds.FileSystemDataset):
    """A dataset whose scanners run on the thread that reads them (`use_threads=False`).

    DuckDB opens a registered dataset's stream with `scanner(...).to_reader()`, which
    pyarrow runs holding the GIL (pyarrow 26), and a threaded scan starts its tasks
    right there, on Arrow's threads. Through a Python file system those tasks need the
    GIL; once a scan has failed on a missing file (a compaction removed it), a later
    `to_reader` was seen to wait on them while holding it: the process hangs for good
    (on S3 for minutes, until killed; 3 of 3 runs of 50 queries over a memory://
    dataset with 15 of its 16 files removed, tests/test_reliability_round6_scan.py).
    A serial scan starts nothing there: its work runs inside the reads, where DuckDB
    has released the GIL, so a missing file fails the query (and `query_store` runs it
    again on the store as it stands). Local stores keep the threaded scan: Arrow's own
    file system never needs the GIL."""

    def scanner(self, *args, **kwargs):
        kwargs["use_threads"] = False
        return super().scanner(*args, **kwargs)


def _advantage_files(
    store: Store, files: StepFiles | None = None, *, warnings: list[str] | None = None
) -> list[str]:
    """The advantage tables of the store's steps files: one per archive segment and inbox
    shard. Tables of shards the archive holds (its segment's table has their rows) and of
    segments it no longer names (merged, or a killed compaction's) are left out, so each
    step has one row per tag."""
    files = step_files(store) if files is None else files
    paths = committed(store, layout.advantages(store.root, "*", "*"))
    if files.manifest is not None:
        alive = set(files.ids())
        paths = [p for p in paths if posixpath.basename(p)[: -len(".parquet")] in alive]
    # writers of other float widths: cast
    return readable(store, paths, None, "advantages", warnings=warnings)


def advantages_source(
    store: Store, filesystem, files: StepFiles | None = None, *, paths: list[str] | None = None
):
    """All advantage tables (`paths`, when the caller listed them; `_advantage_files`
    else); the tag folder becomes the `estimator` column."""
    partitioning = ds.DirectoryPartitioning(
        pa.schema([pa.field(ESTIMATOR, pa.string())]), segment_encoding="none"
    )
    return parquet_source(
        filesystem,
        _advantage_files(store, files) if paths is None else paths,
        ADVANTAGES_VIEW_SCHEMA,
        partitioning=partitioning,
        partition_base_dir=layout.advantages_dir(store.root),
    )


def estimators_table(
    store: Store, files: StepFiles | None = None, *, paths: list[str] | None = None
) -> pa.Table:
    """Per tag: name and parameters from the file metadata of its first file (of `paths`,
    when the caller listed the tables; `_advantage_files` else)."""
    by_tag: dict[str, list[str]] = {}
    for path in _advantage_files(store, files) if paths is None else paths:
        by_tag.setdefault(posixpath.basename(posixpath.dirname(path)), []).append(path)
    rows = []
    for tag, tables in sorted(by_tag.items()):
        with store.fs.open(tables[0], "rb") as handle:
            metadata = pq.read_schema(handle).metadata or {}
        rows.append(
            {
                ESTIMATOR: tag,
                "name": _decode(metadata.get(C.META_ESTIMATOR)),
                "params": _decode(metadata.get(C.META_ESTIMATOR_PARAMS)),
                "shards": len(tables),
            }
        )
    return pa.Table.from_pylist(rows, schema=ESTIMATORS_SCHEMA)


def policy_table(store: Store) -> pa.Table:
    """One row per version that has a folder under policy/ or that LATEST has reached:
    published, stored (complete folder) and is_latest, as storage/registry.py defines them
    (`version_table`: LATEST must name a complete version).

    Versions up to LATEST are published even when pruning removed their folders."""
    return store.policies.version_table(POLICY_SCHEMA)


def learner_metrics_source(store: Store, filesystem):
    """learner/metrics/*.parquet. A column a file lacks reads as NULL; the types of the
    newest file win where it has a column, and columns beyond the contract's pass through."""
    paths = committed(store, layout.metrics(store.root, "*"))
    paths = readable(store, paths, None, "learner_metrics")
    schema = C.LEARNER_METRICS_SCHEMA
    if paths:
        with store.fs.open(paths[-1], "rb") as handle:
            newest = pq.read_schema(handle)
        usable = {f.name: f.with_nullable(True) for f in newest if not pa.types.is_null(f.type)}
        fields = [usable.get(f.name, f) for f in C.LEARNER_METRICS_SCHEMA]
        fields += [f for name, f in usable.items() if name not in C.LEARNER_METRICS_SCHEMA.names]
        schema = pa.schema(fields)
    return parquet_source(filesystem, paths, schema)


def policy_loads_source(store: Store, filesystem):
    """policy/loads/*.parquet: the versions each actor loaded (storage/registry.py
    `LoadLog`), one file per actor process."""
    paths = store.policies.load_files()  # the layout's names, the store's own files
    paths = _with_footers(store, paths, check_loads, "policy_loads")
    return parquet_source(filesystem, paths, LOADS_SCHEMA)


def learner_histograms_table(store: Store) -> pa.Table:
    """The learner's per-update histograms, read here (zarr) and handed over as rows."""
    path = layout.histograms(store.root)
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

        url = layout.histograms(store.url.rstrip("/"))
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
                    "update": np.repeat(np.arange(1, updates + 1, dtype=np.int64), bins),
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

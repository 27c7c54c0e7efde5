"""Recompute advantages for Parquet files or a store's shards: what `gagpo advantages` runs.

Each input file is one batch, processed on its own like a store shard (a shard holds
whole groups), so a group whose rollouts are spread over several files is an error.
Outputs are written under a temporary name and renamed once complete (in a store, by
its atomic commit): a failure leaves nothing at the destination.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from gagpo.pipeline.advantages import POOL_ID, compute_advantages
from gagpo.pipeline.checks import check_schema
from gagpo.pipeline.config import EXACT, EstimatorConfig
from gagpo.pipeline.diagnose import Diagnostics, diagnostics
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError, ValidationError, first_line
from gagpo.schemas.validate import check_group_owners
from gagpo.storage.files import atomic_write

# --out files: snappy writes ~40 % faster than zstd for ~25 % more bytes; a table that
# can be recomputed favours speed. The store's own files stay zstd.
PARQUET_COMPRESSION = "snappy"
COMPRESSIONS = ("snappy", "zstd", "lz4", "none")
# Dictionary-encode the repeating string keys only: trying it on float columns costs
# a third of the write time for nothing.
DICTIONARY_COLUMNS = [C.TRAJ_ID, C.GROUP_ID, C.STATE_KEY, POOL_ID]
# Under a grouping other than exact, each step's pool label (grouping.py) follows the
# schema's columns; readers of the advantages schema ignore it.
POOL_ID_FIELD = pa.field(POOL_ID, pa.string(), nullable=False)
RESOLVES = 20  # times the files are listed again after a compaction moved some of them


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files named by paths or glob patterns, each once, in the order given (sorted per glob)."""
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise GagpoError(
                f"--input {pattern!r} matches no file; accepted: Parquet files or a glob"
            )
        files.extend(m for m in matches if m not in files)
    return files


def _scan(path: str) -> pl.LazyFrame:
    try:
        schema = pl.read_parquet_schema(path)
    except (OSError, pl.exceptions.PolarsError) as exc:
        reason = first_line(exc)
        raise GagpoError(f"{path}: not a readable Parquet file ({reason})") from None
    try:
        check_schema(schema)
    except ValidationError as exc:
        raise ValidationError(f"{path}: {exc}") from None
    return pl.scan_parquet(path).select(C.ADVANTAGE_INPUT_COLUMNS)


def check_groups_within_files(files: list[str]) -> None:
    """A group must sit whole in one file; name the first that does not."""
    if len(files) < 2:
        return
    seen = pl.concat(
        [
            _scan(path).select(pl.col(C.GROUP_ID).unique(), pl.lit(i, pl.Int32).alias("file"))
            for i, path in enumerate(files)
        ]
    )
    spread = (
        seen.group_by(C.GROUP_ID)
        .agg(pl.col("file").unique().sort())
        .filter(pl.col("file").list.len() > 1)
        .sort(pl.col("file").list.first(), C.GROUP_ID)
        .head(1)
        .collect()
    )
    if spread.height:
        group, where = spread[C.GROUP_ID][0], spread["file"][0].to_list()
        raise ValidationError(
            f"group {group!r} is spread over {files[where[0]]} and {files[where[1]]}; "
            "accepted: each group whole in one file (files are processed separately)"
        )


def _with_pools(config: EstimatorConfig) -> bool:
    """Under a grouping other than exact, tables carry `pool_id` (the SQL views' pools)."""
    return config.state_grouping != EXACT


def _arrow(table: pl.DataFrame, config: EstimatorConfig):
    """The table as Arrow in the advantages schema (plus `pool_id` where it has one)."""
    if _with_pools(config):
        return table.to_arrow().cast(C.ADVANTAGES_SCHEMA.append(POOL_ID_FIELD))
    return table.to_arrow().cast(C.ADVANTAGES_SCHEMA)


def advantages_of_files(files: list[str], config: EstimatorConfig) -> pl.DataFrame:
    """The advantages table of every file, each file one batch, in file order."""
    check_groups_within_files(files)
    tables = []
    for path in files:
        try:
            # The in-memory engine runs this plan of whole-column kernels ~15 % faster.
            plan = compute_advantages(_scan(path), config, pool_ids=_with_pools(config))
            tables.append(plan.collect(engine="in-memory"))
        except ValidationError as exc:
            raise ValidationError(f"{path}: {_message(exc)}") from None
    return pl.concat(tables)


def _message(exc: Exception) -> str:
    """The error's own line; Polars may append the expression it was raised in."""
    return first_line(exc)


def advantages_metadata(config: EstimatorConfig) -> dict[bytes, bytes]:
    """File metadata: the estimator's name and its parameters as JSON."""
    return {
        C.META_ESTIMATOR: config.estimator.encode(),
        C.META_ESTIMATOR_PARAMS: config.params_json().encode(),
    }


def check_compression(compression: str) -> None:
    """Fail before any work when the Parquet codec is unknown."""
    if compression not in COMPRESSIONS:
        raise GagpoError(
            f"unknown compression {compression!r}; accepted: {', '.join(COMPRESSIONS)}"
        )


def write_advantages(
    table: pl.DataFrame,
    path: str | Path,
    config: EstimatorConfig,
    compression: str = PARQUET_COMPRESSION,
) -> None:
    """Write an advantages table with its metadata, atomically (temporary name + rename)."""
    check_compression(compression)
    path = check_out(path)
    arrow = _arrow(table, config).replace_schema_metadata(advantages_metadata(config))

    def write(temp: Path) -> None:
        pq.write_table(arrow, temp, compression=compression, use_dictionary=DICTIONARY_COLUMNS)

    try:
        atomic_write(path, write)
    except OSError as exc:  # the file system refused (read-only, /proc, full disk, …)
        raise GagpoError(
            f"--out {str(path)!r} cannot be written ({exc.strerror or exc}); accepted: a file "
            "path in a writable folder"
        ) from None


def check_out(path: str | Path) -> Path:
    """--out as a Path whose folder exists (created if missing); one line if it cannot be."""
    path = Path(path)
    if path.is_dir():
        raise GagpoError(f"--out {str(path)!r} is a directory; accepted: a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GagpoError(
            f"--out {str(path)!r}: folder cannot be created ({exc.strerror or exc}); accepted: a "
            "file path in a writable folder"
        ) from None
    return path


def recompute_files(
    patterns: list[str],
    out: str | Path,
    config: EstimatorConfig,
    compression: str = PARQUET_COMPRESSION,
) -> Diagnostics:
    """Advantages of the input files written to `out`; returns their diagnostics."""
    check_compression(compression)
    check_out(out)  # before the work, not after it
    table = advantages_of_files(expand_inputs(patterns), config)
    write_advantages(table, out, config, compression)
    return diagnostics(table, config.state_grouping)


@dataclass
class ShardResult:
    """One shard's outcome, as a worker returns it: the shard's group ids (None when it did
    not read or validate), the reason to quarantine it, or the encoded advantages file and
    the columns the diagnostics need."""

    ref: Any  # schemas.store.ShardRef
    groups: list[str] | None = None
    error: str | None = None
    data: bytes | None = None
    kept: pl.DataFrame | None = None  # of group_id, traj_id, state_group_size, advantage
    missing: bool = False  # removed or quarantined by another process meanwhile


def shard_task(
    ref, url: str, config, run_id: str | None = None, groups: frozenset[str] | None = None
) -> ShardResult:
    """Read, validate and compute one shard or segment of the store at `url` (run in a
    worker): its rows of `run_id` and of `groups`, when given."""
    import pyarrow.compute as pc

    from gagpo.pipeline.parallel import worker_store
    from gagpo.storage.archive import is_segment
    from gagpo.storage.segments import read_segment

    store = worker_store(url)
    try:
        if is_segment(ref):  # its footer validated (storage/archive.py): only what the stage uses
            columns = list(dict.fromkeys([*C.ADVANTAGE_INPUT_COLUMNS, C.RUN_ID, C.GROUP_ID]))
            shard = read_segment(store, ref.path, columns)
        else:
            shard = store.read_shard(ref)
    except ValidationError as exc:
        return ShardResult(ref, error=_message(exc))
    except FileNotFoundError:
        return ShardResult(ref, missing=True)
    except (pa.ArrowException, OSError) as exc:  # a segment that does not decode
        return ShardResult(ref, error=f"unreadable Parquet file ({_message(exc)})")
    all_groups = shard.column(C.GROUP_ID).unique().to_pylist()
    if run_id is not None:
        shard = shard.filter(pc.equal(shard[C.RUN_ID], run_id))
    if groups is not None:
        shard = shard.filter(
            pc.is_in(shard[C.GROUP_ID], value_set=pa.array(sorted(groups), pa.string()))
        )
    if shard.num_rows == 0:
        return ShardResult(ref, all_groups)
    groups = all_groups
    try:
        frame = pl.from_arrow(shard.select(list(C.ADVANTAGE_INPUT_COLUMNS))).lazy()
        table = compute_advantages(frame, config, pool_ids=_with_pools(config)).collect()
    except (ValidationError, pl.exceptions.PolarsError) as exc:
        return ShardResult(ref, groups, error=_message(exc))
    data = encode_parquet(_arrow(table, config), advantages_metadata(config))
    kept = table.select(C.GROUP_ID, C.TRAJ_ID, C.STATE_GROUP_SIZE, C.ADVANTAGE)
    return ShardResult(ref, groups, data=data, kept=kept)


def encode_parquet(table, metadata: dict[bytes, bytes]) -> bytes:
    """The bytes `Store.write_parquet(table, path, metadata)` commits."""
    from gagpo.storage.store import PARQUET_COMPRESSION

    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression=PARQUET_COMPRESSION)
    return buffer.getvalue()


@dataclass
class StoreSummary:
    """What `recompute_store` did: shard tables written, shards quarantined (path,
    reason), and the diagnostics over all written steps."""

    shards: int = 0  # tables written: one per inbox shard and per archive segment
    segments: int = 0
    quarantined: list[tuple[str, str]] = field(default_factory=list)
    diagnostics: Diagnostics | None = None


def recompute_store(
    url: str,
    run_id: str | None,
    config: EstimatorConfig,
    progress=None,
    *,
    workers: int = 1,
    backend: str | None = None,
    ray_address: str | None = None,
    as_of_update: int | None = None,
) -> StoreSummary:
    """Advantages of the store's steps at `url` (of `run_id`, or of all runs): one table per
    archive segment and per inbox shard (storage/archive.py, the one reader), committed at
    advantages/<tag>/<segment or shard id>.parquet. With `as_of_update`, only the groups
    the store's learner had consumed by that update, under the tag `<tag>@u<update>`.

    A shard that fails validation is moved to quarantine/ with its reason (docs/design.md §7)
    and the others go on; the rules are the learner's (schemas/validate.py), including
    one copy per group: a shard holding a group an earlier file (segments, then shards
    oldest id first) holds is quarantined, so a split or repeated group is never written
    twice. A shard that a compaction moved while this ran is read from its segment.
    `progress(done, total)`, when given, is called before each file and at the end.

    With `workers` > 1 the files are read and computed in parallel (pipeline/parallel.py:
    `backend` processes by default, or ray), at most `workers` at a time; the group rule
    and the commits stay here, in file order, so the store ends exactly as after the
    serial run.
    """
    from gagpo.storage.store import Store

    store = Store(url)
    files = _step_files(store, url, run_id)
    store.ensure_writable()  # one line now, rather than a traceback at the first table
    groups, tag = _as_of(store, config, as_of_update)
    if backend is None:
        backend = "serial" if workers == 1 else "processes"
    parallel = dict(workers=workers, backend=backend, ray_address=ray_address)
    work = _Recompute(store, config, tag, run_id, groups, progress, parallel)
    files = work.every_file(files)
    if progress is not None:
        progress(work.total, work.total)
    return work.summary_of(url, files)


def _step_files(store, url: str, run_id: str | None):
    """The store's step files of `run_id` (or of all runs): its archive segments, then its
    inbox shards; one line when there is none."""
    from gagpo.storage.archive import step_files

    files = step_files(store, run_id)
    if files.empty:
        where = f"shards/run={run_id}/" if run_id else "shards/"
        raise GagpoError(
            f"no committed shard under {url.rstrip('/')}/{where} and no archive segment; "
            "accepted: a store with shards"
        )
    return files


def _as_of(
    store, config: EstimatorConfig, as_of_update: int | None
) -> tuple[frozenset[str] | None, str]:
    """The groups to compute (None: all) and the tag to commit under: with `as_of_update`,
    the groups the learner had consumed by that update, under `<tag>@u<update>`."""
    from gagpo.storage.archive import groups_as_of

    if as_of_update is None:
        return None, config.tag
    groups = frozenset(groups_as_of(store, as_of_update)[C.GROUP_ID].to_pylist())
    return groups, f"{config.tag}@u{as_of_update}"


@dataclass
class _Recompute:
    """One recompute of a store, as far as it has gone: each committed file's diagnostics
    columns (`kept`, by file id), the first file holding each group (`owners`: the
    one-copy rule), the files done, and how many files it has met (`total`, for progress)."""

    store: Any  # storage.store.Store
    config: EstimatorConfig
    tag: str
    run_id: str | None
    groups: frozenset[str] | None
    progress: Any
    parallel: dict[str, Any]  # ordered_map's workers, backend and ray_address
    summary: StoreSummary = field(default_factory=StoreSummary)
    kept: dict[str, pl.DataFrame] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    total: int = 0

    def every_file(self, files):
        """Compute and commit the table of every file of `files`. A file a compaction
        removed meanwhile: list the files again and read the rest, its groups now in a new
        segment, forgetting what the moved files held (at most RESOLVES times). Returns
        the files as last listed."""
        from gagpo.storage.archive import step_files

        for _ in range(RESOLVES):
            refs = [r for r in files.refs(self.store) if r.path not in self.done]
            self.total += len(refs)
            if not self.commit_tables(refs):
                break
            files = step_files(self.store, self.run_id)
            live = set(files.ids())
            self.owners = {g: f for g, f in self.owners.items() if f in live}
            self.kept = {f: t for f, t in self.kept.items() if f in live}
        return files

    def commit_tables(self, refs) -> bool:
        """Compute the tables of `refs` (in parallel when asked) and commit them in file
        order: a file that fails validation or holds a group an earlier file holds is
        quarantined (an archive segment refuses the recompute instead), and each committed
        file's diagnostics columns go to `kept`. Returns whether any file had vanished."""
        from gagpo.pipeline.parallel import ordered_map
        from gagpo.storage.archive import is_segment

        missing = False
        offset = self.total - len(refs)
        args = (self.store.url, self.config, self.run_id, self.groups)
        results = ordered_map(shard_task, refs, args=args, **self.parallel)
        written: list[str] = []  # tables this run added (not rewrote): removed if it fails
        try:
            for i, ref in enumerate(refs):
                if self.progress is not None:
                    self.progress(offset + i, self.total)
                result = next(results)
                self.done.add(ref.path)
                if result.missing:  # quarantined, or moved by a compaction meanwhile
                    missing = True
                    continue
                reason = result.error
                if result.groups is not None:  # read and valid: the one-copy rule comes first
                    try:
                        table = pa.table({C.GROUP_ID: pa.array(result.groups, pa.string())})
                        check_group_owners(table, ref.shard_id, self.owners.get)
                    except ValidationError as exc:
                        reason = _message(exc)
                archived = is_segment(ref)
                if reason is not None and archived:  # archive files are never quarantined
                    raise GagpoError(f"archive segment {ref.path} cannot be used: {reason}")
                if reason is not None:
                    self.store.quarantine(ref.path, reason)
                    self.summary.quarantined.append((ref.path, reason))
                    continue
                self.owners.update(dict.fromkeys(result.groups, ref.shard_id))
                if result.data is None:  # no row of the wanted run or groups in it
                    continue
                path = self.store.advantages_path(self.tag, ref.shard_id)
                if not self.store.exists(path):
                    written.append(path)
                self.store.commit_bytes(path, result.data)
                self.kept[ref.shard_id] = result.kept
        except BaseException:
            # All or nothing: a recompute that fails (a user's key function, an interrupt) leaves
            # no table of its own beside the ones an earlier complete run wrote.
            with contextlib.suppress(Exception):
                self.store.remove_files(written, "the tables of a failed recompute")
            raise
        finally:
            results.close()  # an error here: the workers are stopped
        return missing

    def summary_of(self, url: str, files) -> StoreSummary:
        """The summary once every file is done: tables written (segments among them) and
        the diagnostics over their steps; one line when no file was valid."""
        if not self.kept:
            raise GagpoError(
                f"no valid shard under {url}: all {self.total} failed validation (see quarantine/)"
            )
        self.summary.shards = len(self.kept)
        self.summary.segments = len(self.kept.keys() & {s.id for s in files.segments})
        table = pl.concat(list(self.kept.values()))
        self.summary.diagnostics = diagnostics(table, self.config.state_grouping)
        return self.summary

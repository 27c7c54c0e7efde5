"""Compaction: consumed shards of the inbox become segments of the archive (storage/archive.py).

Only the holder of the store's lease compacts (the learner in the background, or
`gagpo compact`, which takes the lease): one writer of the archive, on object stores too.
One compaction, in this order, each step safe to kill:

1. recover: finish what a killed compaction left (inbox shards the newest manifest moved,
   segments and ledger parts it does not name, and their advantage tables);
2. read the shards (a shard that fails validation is quarantined, as every reader does);
   the newest segment of the same group size joins them while it is below the target
   size, so segments grow to `segment_bytes` instead of one per compaction;
3. write each new segment, its groups in id order (each in the actor's row order), its
   ledger rows, and each advantage tag's tables of those groups, then the list of the
   shards it moves, every file with its own atomic commit;
4. commit the next manifest generation (an exclusive create: the commit point);
5. remove what the previous generation superseded if it deferred removal; then, unless
   this one defers (`defer_removal`), what it superseded itself: the moved inbox shards
   and their advantage tables, then the generation's `cleared` marker (readers stop
   reading its moved list), then the merged segment (storage/removal.py);
6. prune old manifests.

A kill before 4 leaves unnamed files that step 1 of the next compaction removes (readers
never see them: they read what the manifest names); a kill after 4 leaves archived shards
in the inbox that readers skip (the manifest names them) and the next compaction removes.
Deferring removal keeps every file a reader resolved before the commit until the next
commit: a reader whose pass spans one whole compaction needs no second pass (issue 46).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError, ValidationError
from gagpo.schemas.layout import new_id
from gagpo.schemas.validate import check_group_owners, group_size_of, validate_steps
from gagpo.storage.archive import (
    Manifest,
    Segment,
    ledger_part_path,
    manifest_path,
    moved_by,
    moved_json,
    moved_name,
    moved_path,
    read_ledger_part,
    read_manifest,
    segment_path,
)
from gagpo.storage.faults import fault_point
from gagpo.storage.removal import (
    advantage_tables,
    clear_moved,
    clear_superseded,
    prune_manifests,
    recover,
)
from gagpo.storage.segments import checked_segment
from gagpo.storage.store import PARQUET_COMPRESSION, ShardRef, Store, parquet_table

SEGMENT_MIB = 64  # a segment grows to about this many MiB of shards (memory: ~15x that, once)
ROW_GROUP_ROWS = 16_384  # rows per Parquet row group: pushdown by group_id skips the rest
# Groups contiguous, in id order; within a group the actor's own row order (turn by turn),
# kept by a stable sort: the advantage stage's sums run in row order, so a recompute over a
# segment equals the one over its shards bit for bit (benchmarks/compaction_equality.py).
SORT_KEYS = [(C.GROUP_ID, "ascending")]


def _by_group(table: pa.Table) -> pa.Table:
    keys = table.select([name for name, _ in SORT_KEYS]).combine_chunks()
    return table.combine_chunks().take(pc.sort_indices(keys, SORT_KEYS))  # a stable sort


@dataclass
class CompactionResult:
    """What one compaction did."""

    generation: int | None = None  # the manifest it committed (None: nothing to move)
    shards: int = 0  # inbox shards moved into the archive
    groups: int = 0
    rows: int = 0
    segments: int = 0  # segments written (a merged one counts once)
    bytes_written: int = 0
    groups_archived: set[str] = field(default_factory=set)  # their ledger rows are archived now
    quarantined: list[tuple[str, str]] = field(default_factory=list)
    skipped: int = 0  # shards left in the inbox (an older schema version, vanished)
    recovered: int = 0  # files a killed compaction left, removed
    seconds: float = 0.0


def compact(
    store: Store,
    shards: list[ShardRef],
    ledger: pa.Table | None,
    *,
    segment_bytes: int = SEGMENT_MIB * 2**20,
    row_group_rows: int = ROW_GROUP_ROWS,
    check: Callable[[], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    defer_removal: bool = False,
) -> CompactionResult:
    """Move `shards` (inbox shards every group of which may leave the inbox) into the
    archive, with `ledger`'s rows of their groups; `check()` runs right before the
    commit (the lease check). With `defer_removal`, what this generation supersedes
    stays until the next generation commits. See the module docstring for the steps."""
    t0 = time.perf_counter()
    result = CompactionResult()
    manifest = read_manifest(store)
    result.recovered = recover(store, manifest)
    deferred = manifest is not None and manifest.defers and not manifest.cleared
    if deferred:  # its moved shards are still in the inbox: never moved twice
        held = moved_by(store, manifest)
        shards = [r for r in shards if r.shard_id not in held]
    writer = _SegmentWriter(store, manifest, ledger, segment_bytes, row_group_rows)
    moved = writer.write_all(_read_shards(store, shards, result, progress))
    if moved:
        fault_point("compact-written")  # crash tests: every file written, nothing committed
        new = _commit_manifest(store, manifest, writer, moved, check, defer_removal)
        fault_point("compact-committed")  # crash tests: committed, the inbox not yet cleared
        _count(result, new, writer, moved, ledger)
        if deferred:
            clear_superseded(store, manifest)
            fault_point("compact-superseded")  # crash tests: the previous one's files gone
        if not defer_removal:
            clear_moved(store, new, writer.retired, moved, writer.tables)
        prune_manifests(store)
    result.seconds = time.perf_counter() - t0
    return result


class _SegmentWriter:
    """Steps 2 and 3 of one compaction: the shards read, gathered per group size, written
    as segments of about `segment_bytes`; the first segment of a size absorbs the archive's
    open segment of that size (which it then retires). Memory holds one segment's worth."""

    def __init__(
        self,
        store: Store,
        manifest: Manifest | None,
        ledger: pa.Table | None,
        segment_bytes: int,
        row_group_rows: int,
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.segment_bytes = segment_bytes
        self.row_group_rows = row_group_rows
        self.segments = list(manifest.segments) if manifest else []
        self.tables = advantage_tables(store)  # tag → ids of its tables, listed once
        self.written: list[Segment] = []
        self.retired: list[Segment] = []
        self.archived: set[str] = set()  # group ids moved
        self.pending: dict[int, list[tuple[str, pa.Table, int]]] = {}  # group size → shards read
        self.opened: dict[int, Segment | None] = {}  # group size → the segment its first extends

    def write_all(self, reads) -> list[ShardRef]:
        """Write every shard `reads` yields (ref, table, bytes, group size) into segments,
        a segment as soon as the next shard would take it past the target size, the rest
        at the end in group-size order; returns the shards moved, in the order read."""
        moved: list[ShardRef] = []
        for ref, table, size, group_size in reads:
            if group_size not in self.opened:
                self.opened[group_size] = _open_segment(
                    self.segments, group_size, self.segment_bytes
                )
            chunk = self.pending.setdefault(group_size, [])
            open_segment = self.opened[group_size]
            first = open_segment.bytes if open_segment is not None else 0
            if chunk and first + sum(piece[2] for piece in chunk) + size > self.segment_bytes:
                self.flush(group_size)
                chunk = self.pending.setdefault(group_size, [])
            chunk.append((ref.shard_id, table, size))
            self.archived.update(table[C.GROUP_ID].unique().to_pylist())
            moved.append(ref)
        for group_size in sorted(self.pending):
            self.flush(group_size)
        return moved

    def flush(self, group_size: int) -> None:
        """Write the shards read for `group_size` as one segment (the first absorbing the
        open segment of that size), then let them go."""
        chunk = self.pending.pop(group_size, [])
        if not chunk:
            return
        open_segment = self.opened.get(group_size)
        base = []
        if open_segment is not None:
            self.retired.append(open_segment)
            base.append(_segment_with_ledger(self.store, open_segment))
        self.opened[group_size] = None  # later chunks of this size start new segments
        segment = _write_segment(
            self.store,
            chunk,
            base,
            self.ledger,
            group_size,
            self.tables,
            self.row_group_rows,
            open_segment,
        )
        self.written.append(segment)


def _commit_manifest(
    store: Store,
    manifest: Manifest | None,
    writer: _SegmentWriter,
    moved: list[ShardRef],
    check: Callable[[], None] | None,
    defers: bool = False,
) -> Manifest:
    """Step 4: the list of the moved shards, then `check()` (the lease), then the next
    generation's manifest by exclusive create, the commit point: a second compactor that
    got there first refuses this one (one line), and nothing this one wrote is named."""
    generation = manifest.generation if manifest else 0
    retired = {r.id for r in writer.retired}
    kept = [s for s in writer.segments if s.id not in retired]
    moved_file = moved_name(generation + 1, new_id())
    store.commit_bytes(moved_path(store, moved_file), moved_json([r.shard_id for r in moved]))
    new = Manifest(
        generation + 1, tuple(kept + writer.written), moved_file, len(moved), defers=defers
    )
    if check is not None:
        check()
    if not store.create_exclusive(manifest_path(store, new.generation), new.to_json()):
        raise GagpoError(
            f"store {store.url}: archive generation {new.generation} was committed by another "
            "compactor; one compactor per store (the learner holding the lease, or gagpo compact)"
        )
    return new


def _count(
    result: CompactionResult,
    new: Manifest,
    writer: _SegmentWriter,
    moved: list[ShardRef],
    ledger: pa.Table | None,
) -> None:
    """What the committed generation moved, into `result`: a merged segment's groups and
    rows count once (the retired segment's are subtracted), and the groups archived are
    those of the moved shards that the ledger holds."""
    written, retired = writer.written, writer.retired
    result.generation = new.generation
    result.segments = len(written)
    result.shards = len(moved)
    result.bytes_written = sum(s.bytes for s in written)
    result.groups = sum(s.groups for s in written) - sum(s.groups for s in retired)
    result.rows = sum(s.rows for s in written) - sum(s.rows for s in retired)
    if ledger is not None and ledger.num_rows:
        result.groups_archived = writer.archived & set(ledger[C.GROUP_ID].to_pylist())


# --- steps ----------------------------------------------------------------------------
def _read_shards(store, shards, result, progress):
    """Yield (ref, table, bytes, group size) of each shard, validated; bad ones are
    quarantined (as every reader of the inbox does), shards of an older schema version
    left where they are."""
    owners: dict[str, str] = {}
    for done, ref in enumerate(shards):
        if progress is not None:
            progress(done, len(shards))
        if not store.is_own(ref.path):  # a link in the inbox: a bad shard, never followed
            reason = "a symbolic link, or a path outside the store; accepted: the store's own files"
            store.quarantine(ref.path, reason)
            result.quarantined.append((ref.path, reason))
            continue
        try:
            data = store.read_bytes(ref.path)
        except FileNotFoundError:  # quarantined or removed meanwhile
            result.skipped += 1
            continue
        try:
            table = parquet_table(data)
            metadata = table.schema.metadata or {}
            validate_steps(table, metadata)
            check_group_owners(table, ref.shard_id, owners.get)
        except (ValidationError, pa.ArrowException, OSError, ValueError) as exc:
            reason = (
                str(exc) if isinstance(exc, ValidationError) else f"unreadable Parquet file ({exc})"
            )
            store.quarantine(ref.path, reason)
            result.quarantined.append((ref.path, reason))
            continue
        if metadata.get(C.META_SCHEMA_VERSION) != C.STEPS_SCHEMA_VERSION.encode():
            result.skipped += 1  # an older minor version: readers derive its columns
            continue
        owners.update(dict.fromkeys(table[C.GROUP_ID].unique().to_pylist(), ref.shard_id))
        table = table.select(list(C.STEPS_COLUMNS)).cast(C.STEPS_SCHEMA)
        yield ref, table, len(data), group_size_of(metadata)
    if progress is not None:
        progress(len(shards), len(shards))


def _open_segment(segments: list[Segment], group_size: int, limit: int) -> Segment | None:
    """The newest segment of `group_size` still below the target size, if any."""
    for segment in reversed(segments):
        if segment.group_size == group_size:
            return segment if segment.bytes < limit else None
    return None


def _segment_with_ledger(store: Store, segment: Segment) -> tuple[pa.Table, pa.Table | None]:
    """The open segment and its ledger part, validated as every reader validates a
    segment: a bad one refuses the compaction (one line) before it is merged or removed."""
    table = checked_segment(store, segment_path(store, segment.id))
    ledger = None
    if segment.min_update is not None:
        ledger = read_ledger_part(store, segment.id)
    return table, ledger


def _write_segment(
    store, chunk, base, ledger, group_size, advantage_ids, row_group_rows, open_segment
):
    """Write one segment of `chunk`'s shards (plus the open segment in `base`), its ledger
    part and its advantage tables; return its manifest entry."""
    segment_id = new_id()
    tables = [t for t, _ in base] + [t for _, t, _ in chunk]
    steps = pa.concat_tables([t.select(list(C.STEPS_COLUMNS)).cast(C.STEPS_SCHEMA) for t in tables])
    steps = _by_group(steps)
    metadata = {
        C.META_SCHEMA_VERSION: C.STEPS_SCHEMA_VERSION.encode(),
        C.META_GROUP_SIZE: str(group_size).encode(),
        C.META_SOURCE: b"segment",
    }
    data = _parquet_bytes(steps.replace_schema_metadata(metadata), row_group_rows)
    store.commit_bytes(segment_path(store, segment_id), data)
    groups = pc.unique(steps[C.GROUP_ID])
    rows = _ledger_rows(ledger, groups, [lg for _, lg in base if lg is not None])
    if rows is not None:
        store.write_parquet(rows, ledger_part_path(store, segment_id), {})
    sources = [sid for sid, _, _ in chunk] + ([open_segment.id] if open_segment else [])
    for tag, present in advantage_ids.items():
        _write_advantages(
            store, tag, [s for s in sources if s in present], segment_id, row_group_rows
        )
    consumed = rows is not None and rows.num_rows == len(groups)
    updates = rows[C.LEDGER_UPDATE] if rows is not None and rows.num_rows else None
    return Segment(
        id=segment_id,
        rows=steps.num_rows,
        groups=len(groups),
        bytes=len(data),
        group_size=group_size,
        runs=tuple(sorted(pc.unique(steps[C.RUN_ID]).to_pylist())),
        shards=len(pc.unique(steps[C.SHARD_ID])),
        consumed=consumed,
        min_update=None if updates is None else pc.min(updates).as_py(),
        max_update=None if updates is None else pc.max(updates).as_py(),
    )


def _ledger_rows(
    ledger: pa.Table | None, groups: pa.Array, base: list[pa.Table]
) -> pa.Table | None:
    """The ledger rows of `groups`: the open segment's part, then `ledger`'s new ones."""
    parts = [b.select(C.LEDGER_SCHEMA.names).cast(C.LEDGER_SCHEMA) for b in base]
    if ledger is not None and ledger.num_rows:
        fresh = ledger.filter(pc.is_in(ledger[C.GROUP_ID], value_set=groups))
        if parts:
            known = pa.concat_tables(parts)[C.GROUP_ID]
            fresh = fresh.filter(pc.invert(pc.is_in(fresh[C.GROUP_ID], value_set=known)))
        parts.append(fresh.select(C.LEDGER_SCHEMA.names).cast(C.LEDGER_SCHEMA))
    rows = pa.concat_tables(parts) if parts else None
    return rows if rows is not None and rows.num_rows else None


def _write_advantages(
    store: Store, tag: str, sources: list[str], segment_id: str, row_group_rows: int
) -> None:
    """One table of `tag` for the segment: the tables of its source shards (and of the
    segment it extends) that exist, in one file."""
    tables = []
    for source in sources:
        try:
            tables.append(store.read_table(store.advantages_path(tag, source)))
        except FileNotFoundError:
            continue
    if not tables:
        return
    metadata = tables[0].schema.metadata or {}
    table = pa.concat_tables(
        [t.replace_schema_metadata(None) for t in tables], promote_options="default"
    )
    table = _by_group(table).replace_schema_metadata(metadata)
    store.commit_bytes(
        store.advantages_path(tag, segment_id), _parquet_bytes(table, row_group_rows)
    )


def _parquet_bytes(table: pa.Table, row_group_rows: int) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression=PARQUET_COMPRESSION, row_group_size=row_group_rows)
    return buffer.getvalue()

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
5. remove the moved inbox shards and their advantage tables, commit the generation's
   `cleared` marker (readers stop reading its moved list), remove the merged segment;
6. prune old manifests.

A kill before 4 leaves unnamed files that step 1 of the next compaction removes (readers
never see them: they read what the manifest names); a kill after 4 leaves archived shards
in the inbox that readers skip (the manifest names them) and the next compaction removes.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError, ValidationError
from gagpo.schemas.validate import check_group_owners, group_size_of, validate_steps
from gagpo.storage.archive import (
    KEEP_MANIFESTS,
    Manifest,
    Segment,
    advantage_tags,
    checked_segment,
    cleared_path,
    file_groups,
    ledger_part_path,
    manifest_folder,
    manifest_path,
    moved_json,
    moved_name,
    moved_path,
    moved_shards,
    read_ledger_part,
    read_manifest,
    segment_path,
)
from gagpo.storage.faults import fault_point
from gagpo.storage.store import (
    PARQUET_COMPRESSION,
    ShardRef,
    Store,
    new_id,
    parquet_table,
)

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


def recover(store: Store, manifest: Manifest | None = None) -> int:
    """Remove what a killed compaction left behind (see the module docstring); returns the
    number of files removed. Readers never read these files, so this only frees space and
    shortens listings."""
    manifest = read_manifest(store) if manifest is None else manifest
    named = {s.id for s in manifest.segments} if manifest else set()
    removed = 0
    if manifest is not None and not manifest.cleared:
        ids = moved_shards(store, manifest)
        listed = [r for r in store.list_shards() if r.shard_id in ids] if ids else []
        moved = _held_by_archive(store, manifest, listed)
        removed += _remove_advantages(store, [r.shard_id for r in moved])
        removed += _remove(store, [r.path for r in moved])
        store.commit_bytes(cleared_path(store, manifest.generation), b"")
    removed += _remove(store, _stray_moved(store, manifest))
    segments, parts = _ids(store, layout.segment), _ids(store, layout.ledger_part)
    stray = sorted((segments | parts) - named)
    if stray:  # advantage tables and ledger parts first, the segment itself last
        removed += _remove_advantages(store, stray)
        removed += _remove(store, [ledger_part_path(store, i) for i in stray if i in parts])
        removed += _remove(store, [segment_path(store, i) for i in stray if i in segments])
    # a killed commit's temporary files: archive/ has one writer, the lease holder (this one)
    removed += _remove(store, _temporaries(store, stray))
    # tables of files that are gone (a segment merged while a recompute wrote its table)
    removed += _remove(store, _orphan_advantages(store, named))
    return removed


def _held_by_archive(store: Store, manifest: Manifest, refs: list[ShardRef]) -> list[ShardRef]:
    """The shards of `refs` every group of which a segment `manifest`'s generation wrote
    holds. A moved list says which shards a compaction meant to move; the segments say
    what it moved. Only those shards leave the inbox here, so a moved list that lies
    (forged, or naming another run's shards) deletes nothing the archive lacks: the
    others stay, and are read, compacted or trained on as any inbox shard."""
    if not refs:
        return []
    groups: dict[ShardRef, set[str]] = {}
    for ref in refs:
        found = file_groups(store, ref.path)
        if found:
            groups[ref] = found
    held: set[str] = set()
    for segment in _written_by(store, manifest) if groups else []:
        held |= file_groups(store, segment_path(store, segment.id))
    return [ref for ref, ids in groups.items() if ids <= held]


def _written_by(store: Store, manifest: Manifest) -> list[Segment]:
    """The segments `manifest`'s generation added (those its predecessor does not name;
    every segment when the predecessor cannot be read)."""
    before = manifest_path(store, manifest.generation - 1)
    try:
        previous = {s.id for s in Manifest.from_json(store.read_bytes(before), before).segments}
    except (FileNotFoundError, GagpoError):
        previous = set()
    return [s for s in manifest.segments if s.id not in previous]


def _stray_moved(store: Store, manifest: Manifest | None) -> list[str]:
    """Moved-shard sidecars of generations never committed (a compaction killed before its
    commit), and of pruned generations."""
    folder = manifest_folder(store)
    newest = manifest.generation if manifest else 0
    keep = {manifest.moved_file} if manifest else set()
    return [
        moved_path(store, name)
        for generation, names in folder.moved.items()
        for name in names
        if name not in keep and (generation >= newest or generation not in folder.generations)
    ]


def _temporaries(store: Store, stray: list[str]) -> list[str]:
    folders = (layout.segments_dir, layout.ledger_parts_dir, layout.manifests_dir)
    found = [p for folder in folders for p in store.glob(layout.join(folder(store.root), ".tmp-*"))]
    ends = tuple(f"-{i}.parquet" for i in stray)
    if ends:
        for tag in advantage_tags(store):
            pattern = layout.join(layout.advantages_dir(store.root, tag), ".tmp-*")
            found += [p for p in store.glob(pattern) if p.endswith(ends)]
    return found


def _orphan_advantages(store: Store, named: set[str]) -> list[str]:
    """Advantage tables named by neither a segment of the archive nor a shard of the inbox."""
    tables = _advantage_tables(store)
    if not tables:
        return []
    alive = named | {r.shard_id for r in store.list_shards()}
    return [store.advantages_path(tag, i) for tag, ids in tables.items() for i in ids - alive]


def compact(
    store: Store,
    shards: list[ShardRef],
    ledger: pa.Table | None,
    *,
    segment_bytes: int = SEGMENT_MIB * 2**20,
    row_group_rows: int = ROW_GROUP_ROWS,
    check: Callable[[], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> CompactionResult:
    """Move `shards` (inbox shards every group of which may leave the inbox) into the
    archive, with `ledger`'s rows of their groups; `check()` runs right before the
    commit (the lease check). See the module docstring for the steps."""
    t0 = time.perf_counter()
    result = CompactionResult()
    manifest = read_manifest(store)
    result.recovered = recover(store, manifest)
    writer = _SegmentWriter(store, manifest, ledger, segment_bytes, row_group_rows)
    moved = writer.write_all(_read_shards(store, shards, result, progress))
    if moved:
        fault_point("compact-written")  # crash tests: every file written, nothing committed
        new = _commit_manifest(store, manifest, writer, moved, check)
        fault_point("compact-committed")  # crash tests: committed, the inbox not yet cleared
        _count(result, new, writer, moved, ledger)
        _clear_moved(store, new, writer, moved)
        _prune_manifests(store)
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
        self.tables = _advantage_tables(store)  # tag → ids of its tables, listed once
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
) -> Manifest:
    """Step 4: the list of the moved shards, then `check()` (the lease), then the next
    generation's manifest by exclusive create, the commit point: a second compactor that
    got there first refuses this one (one line), and nothing this one wrote is named."""
    generation = manifest.generation if manifest else 0
    retired = {r.id for r in writer.retired}
    kept = [s for s in writer.segments if s.id not in retired]
    moved_file = moved_name(generation + 1, new_id())
    store.commit_bytes(moved_path(store, moved_file), moved_json([r.shard_id for r in moved]))
    new = Manifest(generation + 1, tuple(kept + writer.written), moved_file, len(moved))
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


def _clear_moved(
    store: Store, new: Manifest, writer: _SegmentWriter, moved: list[ShardRef]
) -> None:
    """Step 5: remove the advantage tables of the moved shards and retired segments, then
    the moved shards and the run folders they emptied; commit the generation's `cleared`
    marker so readers stop reading its moved list; then remove the retired segments and
    their ledger parts."""
    gone = [r.shard_id for r in moved] + [old.id for old in writer.retired]
    tables = writer.tables
    _remove(
        store,
        [store.advantages_path(tag, i) for tag, ids in tables.items() for i in gone if i in ids],
    )
    _remove(store, [r.path for r in moved])
    _remove_empty_folders(store, {posixpath.dirname(r.path) for r in moved})
    store.commit_bytes(cleared_path(store, new.generation), b"")  # readers skip the moved list
    for old in writer.retired:
        _remove(store, [ledger_part_path(store, old.id), segment_path(store, old.id)])


def _prune_manifests(store: Store) -> None:
    """Remove the generations older than the newest KEEP_MANIFESTS, their moved lists and
    cleared markers with them (the manifest last: a listing never shows a generation
    without its own files)."""
    folder = manifest_folder(store)
    for generation in folder.generations[:-KEEP_MANIFESTS]:
        _remove(
            store,
            [moved_path(store, n) for n in folder.moved.get(generation, [])]
            + [cleared_path(store, generation)] * (generation in folder.cleared),
        )
        _remove(store, [manifest_path(store, generation)])


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


# --- removal --------------------------------------------------------------------------
def _ids(store: Store, path_of: Callable[[str, str], str]) -> set[str]:
    """The ids of the committed files `path_of(root, id)` names (segments, ledger parts)."""
    return _stems(store.glob(path_of(store.root, "*")))


def _advantage_tables(store: Store) -> dict[str, set[str]]:
    """Per advantage tag, the ids (segment or shard) its committed tables are named by."""
    return {
        tag: _stems(store.glob(layout.advantages(store.root, tag, "*")))
        for tag in advantage_tags(store)
    }


def _stems(paths: list[str]) -> set[str]:
    """The ids files are named by (names without `.parquet`): temporaries (dot names), and
    any name that is no id (schemas/layout.py), left out: not the store's, never removed."""
    stems = (layout.file_id(p) for p in paths)
    return {i for i in stems if layout.is_id(i)}


def _remove_advantages(store: Store, ids: list[str]) -> int:
    """Remove the advantage tables named by `ids` under every tag; returns how many."""
    wanted = set(ids)
    return _remove(
        store,
        [
            store.advantages_path(tag, i)
            for tag, present in _advantage_tables(store).items()
            for i in present & wanted
        ],
    )


def _remove_empty_folders(store: Store, folders: set[str]) -> None:
    """Remove run folders the move emptied (local stores; object stores have no folders).
    An emptied folder still costs every listing a scan (a folder that held 64 k shards:
    `list_shards` 0.21 ms, 0.06 ms once removed); rmdir fails on a folder that is not
    empty, and a shard writer that finds its folder gone creates it again."""
    if not store.is_local:
        return
    for folder in folders:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _remove(store: Store, paths: list[str]) -> int:
    """Delete `paths` (bulk where the backend has it), retried; missing ones are no error."""
    if not paths:
        return 0
    store.remove_files(paths, f"{len(paths)} file(s) of a compaction")
    return len(paths)

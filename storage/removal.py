"""Removal for compactions (storage/compaction.py): what a committed generation superseded,
what a killed compaction left, and old manifests.

A generation's compaction supersedes the inbox shards it moved and the segments it merged
(with their advantage tables and ledger parts). It removes them right after its commit
(`clear_moved`), or, when it defers removal, right after the next generation commits
(`clear_superseded`): a reader that resolved the store before the commit then still
finds every file it named, and needs no second pass (docs/design.md §7). Either way the
generation's `cleared` marker is committed once its moved shards are out of the inbox,
and the merged segments go last. `recover`, at the start of every compaction, finishes
what a kill left: the predecessor of the newest generation if it is not cleared, the
newest if it does not defer removal, then files no live generation names.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Callable

from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError
from gagpo.storage.archive import (
    KEEP_MANIFESTS,
    Manifest,
    Segment,
    advantage_tags,
    cleared_path,
    ledger_part_path,
    manifest_folder,
    manifest_path,
    moved_by,
    moved_path,
    previous_manifest,
    read_manifest,
    segment_path,
)
from gagpo.storage.segments import file_groups
from gagpo.storage.store import ShardRef, Store


def recover(store: Store, manifest: Manifest | None = None) -> int:
    """Remove what a killed compaction left behind (see the module docstring); returns the
    number of files removed. Readers never read these files, so this only frees space and
    shortens listings. What a deferring generation superseded stays while it is the
    newest: the next commit removes it (`clear_superseded`), never a compaction that
    commits nothing, so a reader that resolved its predecessor still finds every file."""
    manifest = read_manifest(store) if manifest is None else manifest
    removed, kept = 0, set()
    if manifest is not None:
        previous = _previous(store, manifest)
        if previous is not None and not manifest.previous_cleared:
            removed += _clear_generation(store, previous)  # killed before it was cleared
        if not manifest.cleared and not manifest.defers:
            removed += _clear_generation(store, manifest)
        elif not manifest.cleared and previous is not None:  # the segments it merged stay
            kept = {s.id for s in previous.segments}
    named = ({s.id for s in manifest.segments} if manifest else set()) | kept
    removed += remove_paths(store, _stray_moved(store, manifest))
    segments, parts = _ids(store, layout.segment), _ids(store, layout.ledger_part)
    stray = sorted((segments | parts) - named)
    if stray:  # advantage tables and ledger parts first, the segment itself last
        removed += _remove_advantages(store, stray)
        removed += remove_paths(store, [ledger_part_path(store, i) for i in stray if i in parts])
        removed += remove_paths(store, [segment_path(store, i) for i in stray if i in segments])
    # a killed commit's temporary files: archive/ has one writer, the lease holder (this one)
    removed += remove_paths(store, _temporaries(store, stray))
    # tables of files that are gone (a segment merged while a recompute wrote its table)
    removed += remove_paths(store, _orphan_advantages(store, named))
    return removed


def _previous(store: Store, manifest: Manifest) -> Manifest | None:
    """`manifest`'s predecessor, None when there is none or it cannot be read."""
    try:
        return previous_manifest(store, manifest)
    except (FileNotFoundError, GagpoError):
        return None


def _clear_generation(store: Store, manifest: Manifest) -> int:
    """Remove the inbox shards `manifest`'s generation moved (those its segments hold),
    their advantage tables and the run folders they emptied, then commit its `cleared`
    marker; returns how many files were removed."""
    ids = moved_by(store, manifest)
    listed = [r for r in store.list_shards() if r.shard_id in ids] if ids else []
    moved = _held_by_archive(store, manifest, listed)
    removed = _remove_advantages(store, [r.shard_id for r in moved])
    removed += remove_paths(store, [r.path for r in moved])
    _remove_empty_folders(store, {posixpath.dirname(r.path) for r in moved})
    store.commit_bytes(cleared_path(store, manifest.generation), b"")
    return removed


def clear_superseded(store: Store, manifest: Manifest) -> None:
    """Right after the next generation committed: remove what deferring `manifest`'s
    generation superseded, its moved shards (then its `cleared` marker), and the
    segments it merged (named by its predecessor, not by it) with their tables and
    ledger parts. A reader that resolved `manifest`'s generation names none of them."""
    _clear_generation(store, manifest)
    previous = _previous(store, manifest)
    live = {s.id for s in manifest.segments}
    merged = [s.id for s in previous.segments if s.id not in live] if previous else []
    if merged:
        _remove_advantages(store, merged)
        remove_paths(store, [ledger_part_path(store, i) for i in merged])
        remove_paths(store, [segment_path(store, i) for i in merged])


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
    before = _previous(store, manifest)
    previous = {s.id for s in before.segments} if before else set()
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
    tables = advantage_tables(store)
    if not tables:
        return []
    alive = named | {r.shard_id for r in store.list_shards()}
    return [store.advantages_path(tag, i) for tag, ids in tables.items() for i in ids - alive]


def clear_moved(
    store: Store,
    new: Manifest,
    retired: list[Segment],
    moved: list[ShardRef],
    tables: dict[str, set[str]],
) -> None:
    """Step 5, at once: remove the advantage tables (`tables`: tag → ids, as listed before
    the compaction) of the moved shards and `retired` segments, then the moved shards and
    the run folders they emptied; commit the generation's `cleared` marker so readers
    stop reading its moved list; then remove the retired segments and their ledger parts."""
    gone = [r.shard_id for r in moved] + [old.id for old in retired]
    remove_paths(
        store,
        [store.advantages_path(tag, i) for tag, ids in tables.items() for i in gone if i in ids],
    )
    remove_paths(store, [r.path for r in moved])
    _remove_empty_folders(store, {posixpath.dirname(r.path) for r in moved})
    store.commit_bytes(cleared_path(store, new.generation), b"")  # readers skip the moved list
    for old in retired:
        remove_paths(store, [ledger_part_path(store, old.id), segment_path(store, old.id)])


def prune_manifests(store: Store) -> None:
    """Remove the generations older than the newest KEEP_MANIFESTS, their moved lists and
    cleared markers with them (the manifest last: a listing never shows a generation
    without its own files)."""
    folder = manifest_folder(store)
    for generation in folder.generations[:-KEEP_MANIFESTS]:
        remove_paths(
            store,
            [moved_path(store, n) for n in folder.moved.get(generation, [])]
            + [cleared_path(store, generation)] * (generation in folder.cleared),
        )
        remove_paths(store, [manifest_path(store, generation)])


# --- removal --------------------------------------------------------------------------
def _ids(store: Store, path_of: Callable[[str, str], str]) -> set[str]:
    """The ids of the committed files `path_of(root, id)` names (segments, ledger parts)."""
    return _stems(store.glob(path_of(store.root, "*")))


def advantage_tables(store: Store) -> dict[str, set[str]]:
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
    return remove_paths(
        store,
        [
            store.advantages_path(tag, i)
            for tag, present in advantage_tables(store).items()
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


def remove_paths(store: Store, paths: list[str]) -> int:
    """Delete `paths` (bulk where the backend has it), retried; missing ones are no error."""
    if not paths:
        return 0
    store.remove_files(paths, f"{len(paths)} file(s) of a compaction")
    return len(paths)

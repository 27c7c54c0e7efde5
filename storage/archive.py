"""The archive: consumed groups compacted out of the inbox (shards/) into large segments.

    STORE/archive/manifest/<generation>.json     the archive as one compaction left it
    STORE/archive/segments/<segment_id>.parquet  steps of whole groups in group-id order
                                                 (each in its actor's row order); zstd
    STORE/archive/ledger/<segment_id>.parquet    the learner's ledger rows of those groups
    STORE/advantages/<tag>/<segment_id>.parquet  a segment's advantage tables, beside the
                                                 per-shard tables of the inbox

Actors keep committing one group file per shard (the inbox: atomic, uncoordinated,
low latency). The single writer that holds the store's lease moves consumed shards into
segments (storage/compaction.py), so listings cost what the unconsumed tail costs and
readers open a few large files instead of one per group.

**The manifest is the truth.** Generation g+1 is created exclusively (never overwritten);
the newest is the archive. It names every live segment, and the file that lists the shards
generation g+1 moved (its `moved` sidecar, written before the commit): those may still
sit in the inbox until their removal completes, after which the compactor commits the
generation's `cleared` marker. A compaction removes what its generation superseded (the
shards it moved, the segments it merged, their tables) right after its commit, or, when it
defers removal (the manifest's `defers_removal`), right after the next generation commits;
before it commits generation g+1 it finishes any removal of generation g-1 a kill cut. So
while generation g is the newest, the only archived shards still in the inbox are those g
moved and, until it is cleared, those g-1 moved. A manifest stays the size of its segment
list; the moved lists (64 000 ids after one `gagpo compact --all` of a long run) are read
only while they can matter: a generation not yet cleared and the inbox not empty.

    archive/manifest/<generation>.json                 the manifest (format 2)
    archive/manifest/<generation>-<id>.moved.json      the shard ids it moved
    archive/manifest/<generation>.cleared              they are out of the inbox

**One reader.** `step_files` resolves "the store's steps" as: the manifest, then the
inbox listing, then the manifest again; if more than one compaction committed between the
two reads it starts again (a sequence lock; after one, the newer generation's moved list
is left out too). The result is every segment plus every inbox shard the archive does not
hold: each group exactly once, also halfway through a compaction.
A file that vanishes after that (a compaction removed a shard it moved, or a segment it
merged) raises FileNotFoundError in the reader, which resolves again (`read_with_retry`).
A reader never takes a missing file for an unreadable one and skips it: its groups are
in a segment its resolution predates, so skipping it loses them (issue 46: the SQL
views' footer checks did). Whatever a reader lists after the resolution (the SQL
views' advantage tables) holds only if the generation is still the one resolved
(inspection/sql_sources.py `step_sources`).
"""

from __future__ import annotations

import json
import posixpath
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError, first_line
from gagpo.storage.resolving import Tries
from gagpo.storage.segments import checked_segment
from gagpo.storage.store import ShardRef, Store, parquet_table

MANIFEST_FORMAT = 2  # 1: the moved shard ids inline (read, never written)
READABLE_FORMATS = (1, 2)
# Older generations kept beside the newest (a reader that listed one just before a prune
# still finds it); the archive needs only the newest.
KEEP_MANIFESTS = 8
MANIFEST_READS = 20  # listings of archive/manifest/ before a manifest that keeps vanishing fails


@dataclass(frozen=True)
class Segment:
    """One segment file of the archive, as its manifest describes it."""

    id: str
    rows: int
    groups: int
    bytes: int
    group_size: int
    runs: tuple[str, ...]
    shards: int  # inbox shards it holds
    consumed: bool  # every group of it has a ledger row (a learner trained on it or dropped it)
    min_update: int | None = None  # ledger updates of its groups (None: no ledger rows)
    max_update: int | None = None


@dataclass(frozen=True)
class Manifest:
    generation: int
    segments: tuple[Segment, ...] = ()
    moved_file: str | None = None  # the sidecar naming the shards it moved (format 2)
    moved_count: int = 0  # how many shards it moved out of the inbox
    created_at: float = field(default_factory=time.time)
    cleared: bool = False  # its moved shards are all out of the inbox (the marker exists)
    inline_moved: frozenset[str] | None = None  # format 1 kept the moved ids in the manifest
    # Its compaction keeps what it superseded (the shards it moved, the segments it merged,
    # their tables) until the next generation commits (`compact(defer_removal=True)`).
    defers: bool = False
    previous_cleared: bool = True  # generation - 1 is cleared, or gone (read with the listing)

    def to_json(self) -> bytes:
        body = {
            "format": MANIFEST_FORMAT,
            "generation": self.generation,
            "created_at": self.created_at,
            "segments": [asdict(s) | {"runs": list(s.runs)} for s in self.segments],
            "moved_file": self.moved_file,
            "moved_count": self.moved_count,
            "defers_removal": self.defers,
        }
        return json.dumps(body, indent=1).encode()

    @classmethod
    def from_json(
        cls, data: bytes, where: str, cleared: bool = False, previous_cleared: bool = True
    ) -> Manifest:
        try:
            body = json.loads(data)
            fmt = body.get("format")
            if fmt not in READABLE_FORMATS:
                raise ValueError(f"format {fmt!r}")
            segments = tuple(Segment(**(s | {"runs": tuple(s["runs"])})) for s in body["segments"])
            _check_entries(segments, body.get("moved_file"), where)
            common = dict(
                generation=int(body["generation"]),
                segments=segments,
                created_at=float(body["created_at"]),
                cleared=cleared,
                defers=body.get("defers_removal", False) is True,
                previous_cleared=previous_cleared,
            )
            if fmt == 1:  # the moved ids inline
                moved = frozenset(body["compacted"])
                return cls(**common, moved_count=len(moved), inline_moved=moved)
            return cls(
                **common, moved_file=body["moved_file"], moved_count=int(body["moved_count"])
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise GagpoError(
                f"{where} is not a readable archive manifest ({exc}); accepted: a manifest "
                f"of format {' or '.join(map(str, READABLE_FORMATS))} written by gagpo compact"
            ) from None

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def groups(self) -> int:
        return sum(s.groups for s in self.segments)


def _check_entries(segments: tuple[Segment, ...], moved_file: object, where: str) -> None:
    """Every name a manifest gives becomes a path: segment ids must be ids (schemas/layout.py,
    `ID_PATTERN`) and the moved list a moved list's own name, or the manifest is refused
    (a GagpoError naming the file and the entry) before any path is built from it."""
    for number, segment in enumerate(segments):
        problem = layout.id_problem(segment.id)
        if problem is not None:
            raise GagpoError(
                f"{where}: segment {number}: {problem}; refused: a manifest names only files "
                "of its own store (restore the manifest from a copy)"
            )
    if moved_file is not None and not layout.is_moved_name(moved_file):
        shown = repr(moved_file)[:80]
        raise GagpoError(
            f"{where}: moved_file {shown} is not a moved list's name; refused: accepted: "
            f"{layout.moved_name('<generation>', '<id>')}, a file beside the manifest"
        )


def moved_shards(store: Store, manifest: Manifest | None) -> frozenset[str]:
    """The shard ids that may still be in the inbox though the archive holds them: those
    `manifest`'s generation moved unless it is cleared, and those its predecessor moved
    unless that one is (a compaction that defers removal leaves them until the next
    generation commits). Older generations are cleared before a generation commits.
    FileNotFoundError when the predecessor's manifest vanished meanwhile (pruned after
    later commits: resolve again)."""
    if manifest is None:
        return frozenset()
    moved = frozenset() if manifest.cleared else moved_by(store, manifest)
    if not manifest.previous_cleared:
        previous = previous_manifest(store, manifest)
        if previous is not None:
            moved |= moved_by(store, previous)
    return moved


def previous_manifest(store: Store, manifest: Manifest) -> Manifest | None:
    """Generation `manifest.generation - 1` (cleared as `manifest` was read: its
    `previous_cleared`); None for the first generation. FileNotFoundError when it is gone."""
    if manifest.generation <= 1:
        return None
    path = manifest_path(store, manifest.generation - 1)
    return Manifest.from_json(store.read_bytes(path), path, manifest.previous_cleared)


def moved_by(store: Store, manifest: Manifest) -> frozenset[str]:
    """The shard ids `manifest`'s generation moved out of the inbox: its sidecar's (format
    1: its inline list)."""
    if manifest.moved_count == 0:
        return frozenset()
    if manifest.inline_moved is not None:
        return manifest.inline_moved
    path = moved_path(store, manifest.moved_file)
    try:
        body = json.loads(store.read_bytes(path))
        shards = body["shards"]
        if not isinstance(shards, list) or not all(isinstance(i, str) for i in shards):
            raise TypeError("'shards' is not a list of shard ids")
        return frozenset(shards)
    except (ValueError, KeyError, TypeError) as exc:
        raise GagpoError(
            f"{path} is not a readable list of moved shards ({exc}); accepted: the file "
            "gagpo compact wrote beside its manifest"
        ) from None


def moved_json(shard_ids: list[str]) -> bytes:
    return json.dumps({"shards": sorted(shard_ids)}).encode()


# --- layout (schemas/layout.py names the files) ---------------------------------------
def manifest_path(store: Store, generation: int) -> str:
    return layout.manifest(store.root, generation)


def segment_path(store: Store, segment_id: str) -> str:
    return layout.segment(store.root, segment_id)


def ledger_part_path(store: Store, segment_id: str) -> str:
    return layout.ledger_part(store.root, segment_id)


def moved_path(store: Store, name: str) -> str:
    """The moved-shards sidecar `name` (`<generation>-<id>.moved.json`)."""
    return layout.moved(store.root, name)


moved_name = layout.moved_name


def cleared_path(store: Store, generation: int) -> str:
    return layout.cleared(store.root, generation)


@dataclass(frozen=True)
class ManifestFolder:
    """One listing of archive/manifest/: committed generations (oldest first), the cleared
    ones, and the moved sidecars by generation."""

    generations: list[int]
    cleared: set[int]
    moved: dict[int, list[str]]  # generation → sidecar file names (one committed, strays)


def manifest_folder(store: Store) -> ManifestFolder:
    generations, cleared, moved = [], set(), {}
    for path in store.glob(layout.join(layout.manifests_dir(store.root), "*")):
        kind, generation = layout.parse_manifest_folder(path) or ("", 0)
        if kind == "moved":
            moved.setdefault(generation, []).append(posixpath.basename(path))
        elif kind == "cleared":
            cleared.add(generation)
        elif kind == "manifest":
            generations.append(generation)
    return ManifestFolder(sorted(generations), cleared, moved)


def manifest_generations(store: Store) -> list[int]:
    """The generations whose manifest is committed, oldest first."""
    return manifest_folder(store).generations


def read_manifest(store: Store) -> Manifest | None:
    """The newest manifest, or None for a store that was never compacted."""
    for _ in range(MANIFEST_READS):
        folder = manifest_folder(store)
        if not folder.generations:
            return None
        newest = folder.generations[-1]
        path = manifest_path(store, newest)
        previous = newest - 1
        settled = previous in folder.cleared or previous not in folder.generations
        try:
            return Manifest.from_json(
                store.read_bytes(path), path, newest in folder.cleared, settled
            )
        except FileNotFoundError:  # pruned between the listing and the read: list again
            continue
    raise GagpoError(f"store {store.url}: the archive manifest kept changing while read")


# --- the one reader -----------------------------------------------------------------
@dataclass(frozen=True)
class StepFiles:
    """What "the store's steps" are at one instant: each group in exactly one file."""

    manifest: Manifest | None
    segments: tuple[Segment, ...]
    shards: tuple[ShardRef, ...]  # inbox shards the archive does not hold, oldest first
    run_id: str | None = None  # segments hold many runs: readers filter rows by it

    def segment_paths(self, store: Store) -> list[str]:
        return [segment_path(store, s.id) for s in self.segments]

    def paths(self, store: Store) -> list[str]:
        """Segments first (older groups), then the inbox tail."""
        return self.segment_paths(store) + [ref.path for ref in self.shards]

    def refs(self, store: Store) -> list[ShardRef]:
        """Every file as a ref: segments first (named by segment id, with no run: a segment
        holds many; `is_segment` tells them apart), then the inbox shards."""
        segments = [ShardRef(segment_path(store, s.id), "", s.id) for s in self.segments]
        return segments + list(self.shards)

    def ids(self) -> list[str]:
        """The id each file's advantage tables are named by: segment ids, then shard ids."""
        return [s.id for s in self.segments] + [ref.shard_id for ref in self.shards]

    @property
    def empty(self) -> bool:
        return not self.segments and not self.shards


def step_files(store: Store, run_id: str | None = None) -> StepFiles:
    """Resolve the store's steps (of `run_id`, when given): see the module docstring."""
    tries = Tries()
    for _ in tries:
        before = read_manifest(store)
        refs = store.list_shards(run_id)
        after = read_manifest(store)
        if generation_of(after) - generation_of(before) not in (0, 1):
            continue
        try:
            moved = _moved_while_listed(store, before, after) if refs else frozenset()
        except FileNotFoundError:  # a predecessor pruned meanwhile: list again
            continue
        break
    else:
        raise GagpoError(
            f"store {store.url}: compactions kept committing while it was listed "
            f"({tries.spent()}); accepted: try again when the store's compactions pause"
        )
    if after is None:
        return StepFiles(None, (), tuple(refs), run_id)
    segments = tuple(s for s in after.segments if run_id is None or run_id in s.runs)
    inbox = tuple(ref for ref in refs if ref.shard_id not in moved)
    return StepFiles(after, segments, inbox, run_id)


def _moved_while_listed(
    store: Store, before: Manifest | None, after: Manifest | None
) -> frozenset[str]:
    """The archived shards a listing made between `before` and `after` (the same
    generation, or the next) may hold: those `before`'s flags say were not yet out of the
    inbox (a generation cleared then was out before the listing began), and all that
    `after` moved when it is a newer generation (its removal may have begun or not)."""
    moved = moved_shards(store, before)
    if after is not None and generation_of(after) != generation_of(before):
        moved |= moved_by(store, after)
    return moved


def is_segment(ref: ShardRef) -> bool:
    """Whether `ref` (from `StepFiles.refs`) is an archive segment rather than a shard."""
    return ref.run_id == ""


def generation_of(manifest: Manifest | None) -> int:
    """The generation of `manifest`; -1 for a store never compacted (None)."""
    return -1 if manifest is None else manifest.generation


T = TypeVar("T")


def read_with_retry(store: Store, read: Callable[[StepFiles], T], run_id: str | None = None) -> T:
    """`read(step_files(store))`, resolved again when a file it names vanished meanwhile
    (a compaction removed it after moving its groups): the groups are then elsewhere.
    Tried as every reader tries (storage/resolving.py); then the last error is raised."""
    for _ in (tries := Tries()):
        files = step_files(store, run_id)
        try:
            return read(files)
        except (OSError, pa.ArrowException) as exc:
            if not is_missing_file(exc) or tries.exhausted():
                raise
    raise AssertionError("unreachable")


def is_missing_file(exc: BaseException) -> bool:
    """Whether `exc` says a file is not there: FileNotFoundError, or the text Arrow, DuckDB
    and object stores give it."""
    if isinstance(exc, FileNotFoundError):
        return True
    text = str(exc)
    return any(
        s in text
        for s in ("No such file", "not found", "NoSuchKey", "does not exist", "FileNotFoundError")
    )


def read_steps_table(
    store: Store,
    columns: list[str] | None = None,
    *,
    run_id: str | None = None,
    groups: set[str] | None = None,
) -> pa.Table:
    """Every step of the store (of `run_id`; of `groups` only, when given) as one table:
    segments, then the inbox tail, each group once. Shards that fail validation are not
    read here (the learner and `gagpo advantages --store` quarantine them): a reader
    of the store's history skips a file it cannot decode.

    When a compaction removes a file before it is read, the store is resolved again and
    only the files this resolution names that were not read yet are read: a file is never
    rewritten (a segment merged is a new one), so the rows of one still named stand. A
    compactor that commits every few seconds then costs a reader the new segment, not a
    fresh start."""
    done: dict[str, pa.Table | None] = {}  # path → its rows (None: it does not decode)

    def read(files: StepFiles) -> pa.Table:
        segments, shards = files.segment_paths(store), [r.path for r in files.shards]
        for path in done.keys() - {*segments, *shards}:
            del done[path]  # merged or moved: its groups are in a file of `files`
        for path in segments:
            if path not in done:
                done[path] = read_file(store, path, columns, run_id, groups, segment=True)
        for path in shards:
            if path not in done:
                done[path] = read_file(store, path, columns, run_id, groups)
        tables = [t for t in (done[p] for p in segments + shards) if t is not None]
        if not tables:
            return _empty(columns)
        return pa.concat_tables(tables, promote_options="default")

    return read_with_retry(store, read, run_id)


def read_file(
    store: Store,
    path: str,
    columns: list[str] | None,
    run_id: str | None = None,
    groups: set[str] | None = None,
    *,
    segment: bool = False,
) -> pa.Table | None:
    """One steps file (shard, or a `segment`), filtered to `run_id` and `groups`; None for
    a shard that cannot be decoded, a one-line refusal for such a segment (`read_segment`).
    FileNotFoundError propagates (the caller resolves again)."""
    wanted = None if columns is None else list(dict.fromkeys([*columns, C.RUN_ID, C.GROUP_ID]))
    if segment:
        table = checked_segment(store, path, wanted)
        return _filtered(table, columns, run_id, groups)
    try:
        table = parquet_table(store.read_bytes(path), wanted)
    except (pa.ArrowException, OSError, ValueError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        return None
    return _filtered(table, columns, run_id, groups)


def _filtered(
    table: pa.Table, columns: list[str] | None, run_id: str | None, groups: set[str] | None
) -> pa.Table:
    """`table`'s rows of `run_id` and `groups` (when given), only `columns` (when given)."""
    mask = None
    if run_id is not None:
        mask = pc.equal(table[C.RUN_ID], run_id)
    if groups is not None:
        inside = pc.is_in(table[C.GROUP_ID], value_set=pa.array(sorted(groups), pa.string()))
        mask = inside if mask is None else pc.and_(mask, inside)
    if mask is not None:
        table = table.filter(mask)
    return table if columns is None else table.select(columns)


def _empty(columns: list[str] | None) -> pa.Table:
    schema = C.STEPS_SCHEMA
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    return schema.empty_table()


# --- the ledger, archive and tail ------------------------------------------------------
def tail_ledger_path(store: Store) -> str:
    return layout.ledger(store.root)


def archived_ledger(store: Store, manifest: Manifest | None = None) -> pa.Table:
    """The ledger rows the archive holds (groups compacted after a learner consumed them)."""
    manifest = read_manifest(store) if manifest is None else manifest
    parts = [
        read_ledger_part(store, s.id)
        for s in (manifest.segments if manifest else ())
        if s.min_update is not None
    ]
    if not parts:
        return C.LEDGER_SCHEMA.empty_table()
    return pa.concat_tables([p.cast(C.LEDGER_SCHEMA) for p in parts])


def read_ledger_part(store: Store, segment_id: str) -> pa.Table:
    """The ledger rows of a segment (the ledger's columns); a part that does not decode or
    lacks a column is refused with one line, as a bad segment is."""
    path = ledger_part_path(store, segment_id)
    try:
        return store.read_table(path).select(C.LEDGER_SCHEMA.names).cast(C.LEDGER_SCHEMA)
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
        raise GagpoError(
            f"archive ledger part {path} cannot be used: {first_line(exc)}; refused: nothing "
            "was read from it or changed (restore the file, or the store, from a copy)"
        ) from None


def read_ledger(store: Store, manifest: Manifest | None = None) -> pa.Table:
    """Every ledger row of the store: the archive's, then the learner's tail
    (`learner/ledger.parquet`: groups not yet compacted). A group in both (a compaction
    committed, its learner not yet past its next update) is counted once."""
    archived = archived_ledger(store, manifest)
    try:
        tail = store.read_table(tail_ledger_path(store))
    except FileNotFoundError:
        return archived
    tail = tail.select(C.LEDGER_SCHEMA.names).cast(C.LEDGER_SCHEMA)
    if archived.num_rows:
        tail = tail.filter(pc.invert(pc.is_in(tail[C.GROUP_ID], value_set=archived[C.GROUP_ID])))
    return pa.concat_tables([archived, tail])


def groups_as_of(store: Store, update: int) -> pa.Table:
    """Ledger rows of the groups consumed (trained or dropped as stale) by updates ≤ `update`,
    in the order they were consumed: the store as it stood after that update."""
    ledger = read_ledger(store)
    if ledger.num_rows == 0:
        raise GagpoError(
            f"--as-of-update {update}: store {store.url} has no learner ledger; accepted: a "
            "store a learner trained on"
        )
    last = pc.max(ledger[C.LEDGER_UPDATE]).as_py()
    if update < 0 or update > last:
        raise GagpoError(
            f"--as-of-update {update} is out of range; accepted: 0 … {last}, the updates "
            f"recorded in {store.url}'s ledger"
        )
    rows = ledger.filter(pc.less_equal(ledger[C.LEDGER_UPDATE], update))
    return rows.take(pc.sort_indices(rows[C.LEDGER_UPDATE]))  # stable: ledger order within one


def advantage_tags(store: Store) -> list[str]:
    """The tag folders under advantages/."""
    tags = []
    for path in store.glob(layout.advantages_dir(store.root, "*")):
        name = posixpath.basename(path.rstrip("/"))
        if not name.startswith(".") and store.fs.isdir(path):
            tags.append(name)
    return sorted(tags)

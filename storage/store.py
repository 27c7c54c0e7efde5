"""The store's file layer: a root URL (local path or fsspec URL) that lists, reads and
commits files, retries, and sweeps. What the files are called is schemas/layout.py's; the
full layout is listed in docs/store.md ("Layout"). Which paths are the store's own is
storage/confine.py's (Store inherits its checks); the fsspec file system under it, and
the local writes a commit syncs, storage/backend.py's. The policy registry (versions, LATEST,
publishing the base policy, fetching a version) sits beside it in storage/registry.py,
reached as `store.policies`.

Commit is atomic: on a local file system a file is written under a hidden temporary
name in its final folder, fsynced and renamed; on object stores it becomes visible with
its single final PUT (or the completion of a multipart upload). Readers list only
committed names, so a crash never exposes a half-written file.

Reliability (docs/design.md §7): listings never come from a cache (other processes add
shards all the time); every operation on the store is retried on transient errors with
bounded backoff (storage/retry.py); temporary files that killed writers left behind are
removed by the next writer into that folder once they are older than `temp_max_age_s`.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import math
import os
import posixpath
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.schemas.errors import (
    GagpoError,
    StoreFullError,
    ValidationError,
    first_line,
    is_disk_full,
    is_missing_bucket,
)
from gagpo.schemas.validate import validate_steps
from gagpo.storage.backend import escaped, fsync_dir, glob_below, mtime, open_fs, write_synced
from gagpo.storage.confine import LINKED_FOLDER, Confined
from gagpo.storage.faults import fault_point
from gagpo.storage.files import TEMP_PREFIX as _TEMP_PREFIX  # one temporary name
from gagpo.storage.files import temporary_beside as _temporary_beside
from gagpo.storage.registry import PolicyRegistry
from gagpo.storage.retry import default_bound_s, env_seconds, retrying

PARQUET_COMPRESSION = "zstd"
# A temporary file untouched this long belongs to a killed writer: a live one writes it in
# seconds and renames it at once. $GAGPO_TEMP_MAX_AGE_S overrides the default.
TEMP_MAX_AGE_S = 3600.0
TEMP_AGE_ENV = "GAGPO_TEMP_MAX_AGE_S"


@dataclass(frozen=True)
class ShardRef:
    """A committed shard: its path in the store and the ids its name carries."""

    path: str
    run_id: str
    shard_id: str


def parquet_table(data: bytes, columns: list[str] | None = None) -> pa.Table:
    """The table of a Parquet file's bytes (only `columns`, when given; a missing one raises
    ArrowInvalid), decoded on the calling thread. Not pq.read_table, nor Arrow's thread
    pool: work of theirs can outlive the call, and a process that exits right after aborts
    now and then ("terminate called without an active exception", apache/arrow#33975;
    measured here: 1–3 % of exits after pq.read_table, ~0.3 % with the pool)."""
    parquet = pq.ParquetFile(pa.BufferReader(data))
    missing = [c for c in columns or [] if c not in parquet.schema_arrow.names]
    if missing:
        raise pa.ArrowInvalid(f"no column {missing[0]!r} in the file")
    return parquet.read(columns=columns, use_threads=False)


class Store(Confined):
    """A GAGPO store rooted at a local path or an fsspec URL."""

    def __init__(
        self,
        url: str,
        *,
        retry_s: float | None = None,
        temp_max_age_s: float | None = None,
        **storage_options: object,
    ) -> None:
        """`retry_s`: how long transient store errors are retried (default
        $GAGPO_STORE_RETRY_S or 180 s); `temp_max_age_s`: age after which a leftover
        temporary file is removed (default $GAGPO_TEMP_MAX_AGE_S or 3600 s)."""
        self.url = str(url)
        self.retry_s = default_bound_s() if retry_s is None else float(retry_s)
        self.temp_max_age_s = _temp_max_age() if temp_max_age_s is None else temp_max_age_s
        self._swept: dict[str, float] = {}  # folder -> when this process last swept it
        try:
            self.fs, self.root = open_fs(self.url, storage_options)
        except ImportError:
            raise GagpoError(
                f"store URL {self.url!r} needs an fsspec backend that is not installed; "
                "for s3:// URLs: pip install 'gagpo[s3]'"
            ) from None
        except (ValueError, TypeError) as exc:
            raise GagpoError(
                f"store URL {self.url!r} cannot be opened ({exc}); accepted: a local path "
                "or an fsspec URL such as file:///data/store or s3://bucket/prefix"
            ) from None
        self.root = self.root.rstrip("/") or "/"
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def retrying(self, what: str, action):
        """`action()`, retried on transient errors for up to `retry_s` (storage/retry.py).
        A full disk or quota (ENOSPC, EDQUOT) and a bucket that does not exist are not
        outages: each is one line (StoreFullError, GagpoError) at once."""
        try:
            return retrying(action, what, bound_s=self.retry_s, where=f"store {self.url}")
        except OSError as exc:
            if is_disk_full(exc):
                raise self.full_error(what, exc) from None
            if is_missing_bucket(exc):
                raise self.missing_bucket_error(what) from None
            raise

    def full_error(self, what: str, exc: BaseException) -> StoreFullError:
        """The one line for a full disk or quota while `what`, with the free space left."""
        return StoreFullError(
            f"store {self.url} is full while {what} ({first_line(exc)}; {self.free_space()}); "
            "nothing torn: what was being written is removed and the previous files stay; "
            "accepted: a store with free space (free some, or name another --store)"
        )

    def missing_bucket_error(self, what: str) -> GagpoError:
        bucket = self.root.split("/", 1)[0]
        return GagpoError(
            f"store {self.url}: bucket {bucket!r} does not exist (deleted, or never created) "
            f"while {what}; accepted: an existing bucket (create it again, or name another store)"
        )

    def free_space(self) -> str:
        """'N MiB free' on a local store (its nearest existing folder), else 'free space unknown'."""
        if not self.is_local:
            return "free space unknown"
        folder = self.root
        while folder and not os.path.exists(folder):
            folder = os.path.dirname(folder.rstrip("/")) or "/"
            if folder == "/":
                break
        try:
            free = shutil.disk_usage(folder or "/").free
        except OSError:
            return "free space unknown"
        return f"{free / 2**20:.1f} MiB free"

    def glob(self, pattern: str) -> list[str]:
        """Paths matching `pattern`, listed afresh (never from a directory cache), retried.
        The store's root in `pattern` is a path, not a pattern: a root holding `[`, `]`, `*`
        or `?` names itself (`glob_below`)."""

        def listing() -> list[str]:
            self.fs.invalidate_cache()
            return glob_below(self.fs, self.root, pattern)

        return self.retrying(f"listing {pattern}", listing)

    def info(self, path: str) -> dict:
        """The backend's description of `path` (size, modification time, …), asked afresh,
        retried; FileNotFoundError when it is not there."""

        def stat() -> dict:
            self.fs.invalidate_cache()
            return self.fs.info(path)

        return self.retrying(f"checking {path}", stat)

    def exists(self, path: str) -> bool:
        """Whether `path` exists now (asked afresh, retried)."""

        def probe() -> bool:
            self.fs.invalidate_cache()
            return self.fs.exists(path)

        return self.retrying(f"checking {path}", probe)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Delete `path` (a folder and its files with `recursive`), retried; a path that is
        not there (any more) is no error."""
        self.confine([path], "removing", link_ok=True)

        def rm() -> None:
            self.fs.invalidate_cache()
            with contextlib.suppress(FileNotFoundError):
                if recursive and self.fs.isdir(path):
                    self._rm_literal([path], recursive=True)
                else:
                    self.fs.rm_file(path)

        self.retrying(f"removing {path}", rm)

    def remove_files(self, paths: list[str], what: str) -> None:
        """Delete the files `paths` (one bulk request where the backend has it), retried;
        files that are not there (any more) are no error. `what`: for the retry line. Every
        path must be the store's own (`confine`: a link is removed as itself, never what it
        names), or nothing is removed."""
        self.confine(paths, f"removing {what}", link_ok=True)

        def rm() -> None:
            self.fs.invalidate_cache()
            present = [p for p in paths if self.fs.exists(p)] if self.is_local else paths
            if not present:
                return
            try:
                self._rm_literal(present)
            except FileNotFoundError:
                for path in present:
                    if self.fs.exists(path):
                        self.fs.rm_file(path)

        self.retrying(f"removing {what}", rm)

    def _rm_literal(self, paths: list[str], *, recursive: bool = False) -> None:
        """fs.rm of `paths` taken as paths. fsspec's rm expands its arguments as glob
        patterns on every backend but the local one, so a path holding `[`, `*` or `?` (a
        store root such as runs/glob[1]) would name nothing, or another store's files:
        such paths are found literally and removed one request each."""
        if self.is_local or not any(glob.has_magic(p) for p in paths):
            self.fs.rm(paths, recursive=recursive)
            return
        for path in paths:
            found = self.fs.find(path) if recursive and self.fs.isdir(path) else [path]
            for file in found:
                self.fs.rm_file(file)

    def makedirs(self, path: str) -> None:
        """Create folder `path` and its parents (object stores: nothing to create), retried."""
        self.retrying(f"creating {path}", lambda: self.fs.makedirs(path, exist_ok=True))

    def download(self, remote_dir: str, local_dir: str) -> None:
        """Copy folder `remote_dir` of the store to `local_dir`, retried."""
        self.retrying(
            f"downloading {remote_dir}",
            lambda: self.fs.get(escaped(remote_dir.rstrip("/")) + "/", local_dir, recursive=True),
        )

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create `path` holding `data` only if nothing is there yet; return whether this
        call created it. Of any number of processes racing, exactly one gets True:

        - a local disk or NFS: the bytes go to a temporary file that is hard-linked to
          `path` (link(2) fails when `path` exists, atomically, NFS included);
        - S3: one PUT with `If-None-Match: *` (AWS S3 and S3-compatible stores that
          implement conditional writes; s3fs `mode="create"`);
        - other fsspec backends: check, then write. Not atomic: two processes racing within
          the same instant can both believe they created it (docs/store.md says so)."""
        if self.is_local:
            return self.retrying(f"creating {path}", lambda: self._link_once(path, data))
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        if "s3" in protocols:

            def put() -> bool:
                try:
                    self.fs.pipe_file(path, data, mode="create")
                except FileExistsError:
                    return False
                except OSError as exc:  # s3fs without the If-None-Match condition in the reply
                    if "Precondition" in str(exc):
                        return False
                    raise
                return True

            return self.retrying(f"creating {path}", put)

        def check_then_put() -> bool:
            self.fs.invalidate_cache()
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True

        return self.retrying(f"creating {path}", check_then_put)

    def _link_once(self, path: str, data: bytes) -> bool:
        parent = posixpath.dirname(path)
        os.makedirs(parent, exist_ok=True)
        temp = _temporary_beside(path)
        try:
            write_synced(temp, data)
            try:
                os.link(temp, path)
            except FileExistsError:
                return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        fsync_dir(parent)
        return True

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @cached_property
    def policies(self) -> PolicyRegistry:
        """The policy registry beside this file layer: versions, LATEST, publish, fetch
        (storage/registry.py)."""
        return PolicyRegistry(self)

    # --- names (schemas/layout.py) ----------------------------------------------------
    def path(self, *parts: str) -> str:
        """`parts` joined under the root. Modules name store files through schemas/layout.py
        (tests/test_layout_owner.py); this is for tests and ad-hoc tools."""
        return layout.join(self.root, *parts)

    def shard_path(self, run_id: str, shard_id: str) -> str:
        return layout.shard(self.root, run_id, shard_id)

    def advantages_path(self, tag: str, file_id: str) -> str:
        return layout.advantages(self.root, tag, file_id)

    # --- writing --------------------------------------------------------------------
    def ensure_writable(self) -> None:
        """Fail early, with one line, when the store cannot be written."""
        probe = self.path(f"{_TEMP_PREFIX}probe-{uuid.uuid4().hex}")

        def write_probe() -> None:
            self.fs.makedirs(self.root, exist_ok=True)
            try:
                self.fs.pipe_file(probe, b"ok")
            finally:  # a full disk may leave the probe created but empty: never leave it
                with contextlib.suppress(Exception):
                    self.fs.rm_file(probe)

        try:
            self.retrying("writing a probe file", write_probe)
            self.sweep_temporaries(self.root)  # probes of killed processes
        except GagpoError:  # an outage, a full disk, a missing bucket: already one line
            raise
        except Exception as exc:  # any other backend error means "not writable" to the user
            reason = getattr(exc, "strerror", None) or _first_line(exc)[:200]
            raise GagpoError(
                f"store {self.url!r} cannot be written ({reason}); accepted: a writable "
                "local folder or fsspec URL"
            ) from None

    def make_readable(self, path: str) -> None:
        """Folders uploaded to the store (policy versions, checkpoints) are read by
        processes that may run as other users on a shared store: files 0644 and folders
        0755, as any model folder, whatever the umask or the modes of the files they were
        copied from. Object stores: nothing to do."""
        if not self.is_local:
            return
        os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
        for folder, dirs, files in os.walk(path):
            for names, mode in ((dirs, 0o755), (files, 0o644)):
                for name in names:
                    # Ranks of a sharded commit upload into one folder at once: another
                    # rank's temporary file may be renamed between the walk and the chmod
                    # (its final name is then visited by that rank's own walk).
                    with contextlib.suppress(FileNotFoundError):
                        os.chmod(os.path.join(folder, name), mode)

    def commit_bytes(self, path: str, data: bytes) -> None:
        """Make `data` visible at `path` atomically (see module docstring), retrying
        transient errors; the caller keeps `data` until this returns. `path` must be the
        store's own (`confine`): a commit never writes outside the root or through a link."""
        self.confine([path], "committing")
        self.retrying(f"committing {path}", lambda: self._commit_once(path, data))

    def _commit_once(self, path: str, data: bytes) -> None:
        parent = posixpath.dirname(path)
        phase = f"commit-{posixpath.relpath(path, self.root).split('/', 1)[0]}"
        if not self.is_local:
            # Object stores: one PUT (or one completed multipart upload) is atomic.
            fault_point(phase)  # crash tests (storage/faults.py)
            self.fs.pipe_file(path, data)
            return
        os.makedirs(parent, exist_ok=True)
        self._sweep_now_and_then(parent)
        temp = _temporary_beside(path)
        try:
            try:
                write_synced(temp, data)
            except FileNotFoundError:  # a compaction removed the emptied folder meanwhile
                os.makedirs(parent, exist_ok=True)
                write_synced(temp, data)
            fault_point(phase)  # crash tests: killed with the temporary file written
            os.replace(temp, path)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise
        fsync_dir(parent)

    def sweep_temporaries(self, folder: str) -> list[str]:
        """Remove the temporary files (and staging folders) in `folder` that are older than
        `temp_max_age_s`: leftovers of killed writers. Returns what was removed. Best
        effort: housekeeping never fails the commit that triggered it."""
        cutoff = time.time() - self.temp_max_age_s
        removed = []
        try:
            entries = self.fs.ls(folder, detail=True)
        except Exception:  # a missing folder, an outage: sweep another time
            return removed
        for entry in entries:
            name = posixpath.basename(entry["name"].rstrip("/"))
            if not name.startswith(_TEMP_PREFIX) or mtime(entry) > cutoff:
                continue
            with contextlib.suppress(OSError):  # swept by another writer first, not ours
                self._rm_literal([entry["name"]], recursive=entry.get("type") == "directory")
                removed.append(entry["name"])
        return removed

    def _sweep_now_and_then(self, folder: str) -> None:
        """Sweep `folder` on this process's first commit into it, then every quarter of
        the age bound: a listing now and then, not per commit. A killed actor's run folder
        gets no further writer (a restart starts a new run), so a shard writer sweeps
        every run folder under shards/."""
        shards = layout.shards_dir(self.root)
        key = shards if posixpath.dirname(folder) == shards else folder
        now = time.monotonic()
        if now - self._swept.get(key, -math.inf) < self.temp_max_age_s / 4:
            return
        self._swept[key] = now
        folders = [folder]
        if key == shards:
            with contextlib.suppress(Exception):  # best effort, as sweep_temporaries
                entries = self.fs.ls(shards, detail=True)
                folders = [e["name"] for e in entries if e.get("type") == "directory"]
        for name in folders:
            self.sweep_temporaries(name)

    def write_parquet(self, table: pa.Table, path: str, metadata: dict[bytes, bytes]) -> None:
        """Serialise `table` as zstd Parquet with `metadata` and commit it at `path`."""
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
        buffer = io.BytesIO()
        pq.write_table(table, buffer, compression=PARQUET_COMPRESSION)
        self.commit_bytes(path, buffer.getvalue())

    def write_shard(
        self, table: pa.Table, *, group_size: int, extra_metadata: dict[bytes, bytes] | None = None
    ) -> ShardRef:
        """Validate a steps table of whole groups and commit it as one shard; `extra_metadata`
        adds file-metadata keys (e.g. gagpo.source = demonstration)."""
        table = table.select(list(C.STEPS_COLUMNS)).cast(C.STEPS_SCHEMA)
        metadata = {
            **(extra_metadata or {}),
            C.META_SCHEMA_VERSION: C.STEPS_SCHEMA_VERSION.encode(),
            C.META_GROUP_SIZE: str(group_size).encode(),
        }
        validate_steps(table, metadata)  # the writer never commits what a reader would reject
        run_ids = table.column(C.RUN_ID).unique().to_pylist()
        shard_ids = table.column(C.SHARD_ID).unique().to_pylist()
        if len(run_ids) != 1 or len(shard_ids) != 1:
            raise ValidationError("a shard holds exactly one run_id and one shard_id")
        ref = ShardRef(self.shard_path(run_ids[0], shard_ids[0]), run_ids[0], shard_ids[0])
        self.write_parquet(table, ref.path, metadata)
        return ref

    # --- reading --------------------------------------------------------------------
    def list_shards(self, run_id: str | None = None) -> list[ShardRef]:
        """Committed shards, oldest id first, as the store holds them now (never a cached
        listing); temporary files are never listed."""
        refs = []
        for path in self.glob(layout.shard(self.root, run_id or "*", "*")):
            if parts := layout.parse_shard(path):
                refs.append(ShardRef(path, *parts))
        return sorted(refs, key=lambda ref: (ref.shard_id, ref.run_id))

    def read_table(self, path: str, columns: list[str] | None = None) -> pa.Table:
        """Read a Parquet file of the store (only `columns`, when given), schema metadata
        kept. Transient errors are retried; FileNotFoundError and decoding errors
        (pa.ArrowException) propagate."""

        return parquet_table(self.read_bytes(path), columns)

    def read_bytes(self, path: str) -> bytes:
        """The bytes of a file of the store (`confine`: never outside it, never through a
        symbolic link); transient errors retried."""
        self.confine([path], "reading")
        return self.retrying(f"reading {path}", lambda: self.fs.cat_file(path))

    def read_shard(
        self, ref: ShardRef | str, *, vocab_size: int | None = None, latest: int | None = None
    ) -> pa.Table:
        """Read and validate a shard (token ids below `vocab_size`, policy versions at most
        `latest`, when given); raise ValidationError naming the reason. Store outages are retried, never blamed on the
        shard; a shard removed meanwhile raises FileNotFoundError."""
        path = ref.path if isinstance(ref, ShardRef) else ref
        if not self.is_own(path):  # a link in shards/ is a bad shard: quarantined, never read
            raise ValidationError(
                "a symbolic link, or a path outside the store; accepted: the store's own files"
            )
        data = self.read_bytes(path)
        try:
            table = parquet_table(data)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise ValidationError(f"unreadable Parquet file ({_first_line(exc)})") from None
        validate_steps(table, table.schema.metadata, vocab_size=vocab_size, latest=latest)
        return table

    def iter_valid_shards(self, refs: list[ShardRef]) -> Iterator[tuple[ShardRef, pa.Table]]:
        """Read shards in turn; a shard that fails validation is quarantined and skipped."""
        for ref in refs:
            try:
                yield ref, self.read_shard(ref)
            except ValidationError as exc:
                self.quarantine(ref.path, str(exc))
            except FileNotFoundError:  # quarantined or removed by another process meanwhile
                continue

    def quarantine(self, path: str, reason: str) -> str:
        """Move a bad file to quarantine/ with a reason file beside it; return its new path.
        A file another process moved first is left to it. A symbolic link is moved as
        itself: what it names is never touched. A file in a folder reached through a link
        (a run folder linked elsewhere) is not the store's to move: it stays where it is,
        and the reason record says so."""
        real_root = os.path.realpath(self.root) if self.is_local else ""
        why = self._outside(path, real_root, {}, True)
        if why not in (None, LINKED_FOLDER):
            self.confine([path], "quarantining", link_ok=True)  # raises: outside the root
        if why is not None:
            reason = f"{reason} (left in place: it {why})"
        dest = layout.quarantined(self.root, path)
        folder = layout.quarantine_dir(self.root)
        self.retrying(f"creating {folder}", lambda: self.fs.makedirs(folder, exist_ok=True))
        note = {
            "original_path": path,
            "reason": reason,
            "quarantined_at": datetime.now(UTC).isoformat(),
        }
        self.commit_bytes(layout.reason(dest), json.dumps(note, indent=2).encode())
        if why is None:
            with contextlib.suppress(FileNotFoundError):
                self.retrying(f"moving {path} to quarantine/", lambda: self._move(path, dest))
        return dest

    def _move(self, path: str, dest: str) -> None:
        """Move file `path` to `dest`: a rename locally; a copy, then a removal, elsewhere
        (fsspec's mv would expand a path holding `[`, `*` or `?` as a glob pattern)."""
        if self.is_local:
            self.fs.mv(path, dest)
            return
        self.fs.cp_file(path, dest)
        self.fs.rm_file(path)

    def quarantined(self) -> list[dict]:
        """Reason records of every quarantined file."""
        out = []
        for path in sorted(self.glob(layout.reasons(self.root))):
            out.append(json.loads(self.read_bytes(path)))
        return out


def _temp_max_age() -> float:
    return env_seconds(TEMP_AGE_ENV, TEMP_MAX_AGE_S, allow_zero=False)


_first_line = first_line  # one summary of an exception everywhere (storage/retry.py)

"""The policy registry of a store: the published versions `policy/v<N>/` and the
`policy/LATEST` pointer (docs/design.md §4), built on the store's file layer
(storage/store.py) and named by schemas/layout.py. Reached as `store.policies`.

A version folder is loadable once its `.complete` marker exists, and LATEST only ever
names such a folder: the learner writes a version, marks it, then moves LATEST (learner/
publish.py); the actors publish the base policy as v0 without moving LATEST.

One meaning of each word, used by the learner (publication, pruning, lineage checks),
held-out evaluation and the `policy_versions` SQL view (docs/design.md §3):

- a version *folder* is `policy/v<N>/`, complete or not (a crashed or in-flight
  publication has no `.complete` marker yet);
- a version is *stored* when its folder is complete: it can be loaded now;
- a version is *published* once `policy/LATEST` has reached it. The learner publishes
  versions in order, one per update, each complete before LATEST moves to it, and LATEST
  never moves back; so every version up to LATEST was published, including those whose
  folders pruning has since removed (published and not stored: *pruned*). v0, the base
  policy, is published by the actors, who commit its folder without moving LATEST: it is
  published once stored. A complete folder beyond LATEST (a publication killed between
  its marker and LATEST) is stored but not published.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import uuid
from datetime import UTC, datetime
from functools import partial

import numpy as np
import pyarrow as pa

from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError, is_disk_full
from gagpo.storage import delta
from gagpo.storage.files import TEMP_PREFIX
from gagpo.storage.policy_cache import VersionCache


class PolicyRegistry:
    """The policy versions of `store` (a storage/store.py `Store`, which imports this
    module: the type is not named here, so the two modules form no import cycle)."""

    def __init__(self, store) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"PolicyRegistry({self.store.url!r})"

    def dir(self, version: int) -> str:
        """The store path of version `version`'s folder, complete or not."""
        return layout.policy_dir(self.store.root, version)

    def latest(self, *, complete: bool = False) -> int | None:
        """The version policy/LATEST names, or None before the first publication. LATEST
        is one file holding a version number (`layout.parse_latest`: 0 to MAX_VERSION - 1,
        at most LATEST_MAX_BYTES read); anything else (a folder, a link, -5, a number past
        the bound, text) is refused in one line naming it. With `complete`, the version
        must also be complete: LATEST is read again when it moved meanwhile (a learner
        publishing and pruning), and a LATEST that stays on an incomplete version is
        refused."""
        for _ in range(LATEST_READS):
            version = self._read_latest()
            if not complete or version is None or self.has(version):
                return version
            if self._read_latest() == version:
                raise GagpoError(
                    f"{layout.latest(self.store.root)} names v{version}, which is no complete "
                    f"version ({layout.complete(self.dir(version))} is missing); accepted: "
                    "LATEST naming a complete policy version"
                )
        raise GagpoError(
            f"{layout.latest(self.store.root)} moved {LATEST_READS} times while being read; "
            "accepted: a store whose LATEST names a complete version"
        )

    def _read_latest(self) -> int | None:
        path = layout.latest(self.store.root)
        try:
            raw = read_head(self.store, path, layout.LATEST_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise GagpoError(
                f"{path} is a folder; accepted: a file holding a version number such as 7"
            ) from None
        version = layout.parse_latest(raw)
        if version is None:
            shown = raw[: layout.LATEST_MAX_BYTES].decode(errors="replace").strip()
            more = "…" if len(raw) > layout.LATEST_MAX_BYTES else ""
            raise GagpoError(
                f"{path} holds {shown!r}{more}; accepted: a version number from 0 to "
                f"{layout.MAX_VERSION - 1}, such as 7"
            )
        return version

    def set_latest(self, version: int) -> None:
        """Point LATEST at `version`; call only once that version is complete."""
        self.store.commit_bytes(layout.latest(self.store.root), layout.latest_text(version))

    def has(self, version: int) -> bool:
        """Whether version `version` is completely written (its `.complete` marker exists)."""
        return self.store.exists(layout.complete(self.dir(version)))

    def publish_base(self, local_dir: str) -> str:
        """Publish the base model folder as v0, once; safe when actors race. Returns its
        store path.

        Locally a staging folder is renamed into place (the loser of a race discards its
        copy). On object stores every writer PUTs the same bytes (presets are
        deterministic), each PUT atomic, and commits the marker last; nothing is deleted.
        """
        store = self.store
        remote = self.dir(0)
        if self.has(0):
            return remote
        names = sorted(n for n in os.listdir(local_dir) if not n.startswith("."))
        marker = json.dumps({"files": names, "source": str(local_dir)}).encode()
        if not store.is_local:
            for name in names:
                dest = posixpath.join(remote, name)
                upload = partial(store.fs.put_file, os.path.join(local_dir, name), dest)
                store.retrying(f"uploading {dest}", upload)
            store.commit_bytes(layout.complete(remote), marker)
            return remote
        policies = layout.policy_root(store.root)
        staging = posixpath.join(policies, f"{TEMP_PREFIX}v0-{uuid.uuid4().hex}")
        os.makedirs(policies, exist_ok=True)
        store.sweep_temporaries(policies)  # staging folders of killed actors
        try:
            shutil.copytree(local_dir, staging, ignore=shutil.ignore_patterns(".*"))
            with open(layout.complete(staging), "wb") as handle:
                handle.write(marker)
            store.make_readable(staging)
        except BaseException as exc:  # a full disk, a kill: no staging folder left behind
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OSError) and is_disk_full(exc):
                raise store.full_error(f"publishing the base policy as {remote}", exc) from None
            raise
        try:
            os.rename(staging, remote)  # atomic; fails if another actor's v0 is already there
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
        return remote

    def folders(self) -> list[int]:
        """Every version folder under policy/, complete or not, ascending."""
        store, versions = self.store, []
        for path in store.glob(layout.policy_dir(store.root, "*")):
            version = layout.parse_policy_dir(path)
            if version is None:
                continue
            if store.retrying(f"checking {path}", lambda p=path: store.fs.isdir(p)):
                versions.append(version)
        return sorted(versions)

    def stored(self) -> list[int]:
        """The versions whose folders are complete (loadable now), ascending."""
        return [v for v in self.folders() if self.has(v)]

    def is_delta(self, version: int) -> bool:
        """Whether version `version` is stored as a delta (storage/delta.py)."""
        return self.store.exists(layout.delta(self.dir(version)))

    def base_of(self, version: int) -> int | None:
        """The version a delta version was taken against (checked: a version below
        `version`, storage/delta.py `parse_record`); None for a full version."""
        path = layout.delta(self.dir(version))
        try:
            raw = read_head(self.store, path, delta.RECORD_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        return int(delta.parse_record(raw, path, version)["base"])

    def needed_by(self, versions: set[int]) -> set[int]:
        """`versions` and every version their deltas are applied to, down to the nearest
        full ones: what pruning must keep for `versions` to stay loadable."""
        needed, todo = set(), sorted(versions)
        while todo:
            version = todo.pop()
            if version in needed:
                continue
            needed.add(version)
            base = self.base_of(version)
            if base is not None:
                todo.append(base)
        return needed

    def fetch(self, version: int, cache_dir: str) -> str:
        """A local folder holding version `version` whole, loadable as it is (transformers,
        vLLM, the learner's resume): a full version of a local store is its own folder; any
        other is a copy under `cache_dir` (storage/policy_cache.py), made once. A delta
        version is applied there to its base: an actor holding the previous version
        downloads the delta alone, any other reader the nearest full version and the
        deltas after it.

        The chain is resolved before anything is downloaded: each base is below its delta
        (`base_of`), so the chain descends and ends, and one longer than delta.MAX_CHAIN is
        refused. Every file read is the store's own: a version folder, or a file in it,
        that is a symbolic link is refused in one line (`own_folder`)."""
        cache = VersionCache(cache_dir, self.store.url)
        chain: list[tuple[int, int | None]] = []  # (version, base) still to build, newest first
        at, folder = version, None
        while folder is None:
            folder = cache.whole(at)
            if folder is not None:
                break
            base = self.base_of(at)
            if base is None and self.store.is_local:
                folder = self.own_folder(at)
                break
            chain.append((at, base))
            if base is None:
                break
            if len(chain) > delta.MAX_CHAIN:
                raise GagpoError(
                    f"{self.dir(version)} is a delta on a chain of more than {delta.MAX_CHAIN} "
                    f"deltas (down to {self.dir(base)}); refused: accepted chains are at most "
                    f"{delta.MAX_CHAIN} deltas long (publish_delta_every <= 100)"
                )
            at = base
        for at, base in reversed(chain):
            below = folder
            folder = cache.build(
                at, lambda staging, a=at, b=base, f=below: self._make(a, b, f, staging)
            )
        return str(folder)

    def _make(self, version: int, base: int | None, below, staging: str) -> None:
        """Download version `version` into `staging` and, a delta, apply it to `below`
        (the whole folder of `base`)."""
        remote = self.dir(version)
        self.download_checked(remote, staging)
        if not os.path.exists(layout.complete(staging)):  # pruned meanwhile
            raise FileNotFoundError(f"{remote} is not a complete policy version")
        record = delta.read_record(staging, version)
        if (record["base"] if record is not None else None) != base:
            raise GagpoError(
                f"{layout.delta(remote)} changed while it was fetched (base "
                f"{record and record['base']} then {base}); accepted: a version left as published"
            )
        if record is not None:
            delta.apply_folder(staging, below, version)

    def own_folder(self, version: int) -> str:
        """A local store's folder of version `version`, once every file in it is checked
        to be the store's own (no link: neither the folder, nor a file, nor a folder on
        the way); refused in one line naming the first that is not."""
        remote = self.dir(version)
        found = [remote]
        if not os.path.islink(remote):
            for folder, dirs, files in os.walk(remote):
                found += [os.path.join(folder, name) for name in (*dirs, *files)]
        confine_own(self.store, found, f"reading policy v{version}")
        return remote

    def download_checked(self, remote: str, local: str) -> None:
        """Copy the store's folder `remote` to `local` once every file in it is checked to
        be its own: on a local store no link (`own_folder`'s rule), on an object store no
        key whose name climbs out of the folder."""
        if self.store.is_local:
            version = layout.parse_policy_dir(remote)
            if version is not None and remote == self.dir(version):
                self.own_folder(version)
            else:
                found = [remote] + [
                    os.path.join(f, n) for f, d, fs in os.walk(remote) for n in (*d, *fs)
                ]
                confine_own(self.store, found, f"downloading {remote}")
        else:
            listed = self.store.retrying(f"listing {remote}", lambda: self.store.fs.find(remote))
            prefix = remote.rstrip("/") + "/"
            for key in listed:
                parts = key[len(prefix) :].split("/") if key.startswith(prefix) else [".."]
                if any(part in ("", ".", "..") for part in parts):
                    raise GagpoError(
                        f"store {self.store.url}: {key!r} is listed in {remote} but names no "
                        "file of it; refused: a store reads only its own files"
                    )
        self.store.download(remote, local)

    def load_files(self) -> list[str]:
        """The committed loads files (`layout.loads`): names of the layout's grammar, the
        store's own (no link), temporaries and other names left out."""
        store = self.store
        paths = store.glob(layout.loads(store.root, "*", "*"))
        return sorted(p for p in paths if layout.parse_loads(p) and store.is_own(p))

    def version_table(self, schema: pa.Schema) -> pa.Table:
        """One row per version that has a folder under policy/ or that LATEST has reached
        (`schema`: version, published, stored, is_latest; see the module docstring). LATEST
        must name a complete version, so the rows are at most MAX_VERSION plus the folders;
        they are built as columns, not row by row."""
        latest = self.latest(complete=True)
        folders = self.folders()
        stored = np.array(self.stored(), dtype=np.int64)
        upto = latest + 1 if latest is not None else 0
        beyond = np.array([v for v in folders if v >= upto], dtype=np.int64)
        versions = np.concatenate([np.arange(upto, dtype=np.int64), beyond])
        is_stored = np.isin(versions, stored)
        # published: LATEST has reached it, or it is the base policy v0 and stored
        published = (versions < upto) | ((versions == 0) & is_stored)
        columns = [versions, published, is_stored, versions == (-1 if latest is None else latest)]
        return pa.Table.from_arrays([pa.array(c) for c in columns], schema=schema)


def confine_own(store, paths: list[str], what: str) -> None:
    """Refuse, in one line naming the first offender by its path in the store, unless
    every one of `paths` is a file of `store` (`Store.is_own`: under the root, reached
    through no symbolic link, itself no link)."""
    for path in paths:
        if store.is_own(path):
            continue
        shown = posixpath.relpath(posixpath.normpath(path), store.root)
        why = (
            "is a symbolic link"
            if store.is_local and os.path.islink(path)
            else "lies outside the store or in a folder reached through a symbolic link"
        )
        raise GagpoError(
            f"store {store.url}: {what}: {shown} {why}; refused: a store reads only its own "
            "files, under its root and never through a symbolic link"
        )


def read_head(store, path: str, limit: int) -> bytes:
    """At most `limit` bytes of the store's file `path` (`Store.confine`: its own, no link),
    so a small record (LATEST, delta.json) that a hostile store made huge is never read
    whole; transient errors retried."""
    confine_own(store, [path], "reading")
    return store.retrying(f"reading {path}", lambda: store.fs.cat_file(path, start=0, end=limit))


LATEST_READS = 5  # reads of a LATEST that moves while a reader checks its version


# policy/loads/<run_id>-<id>.parquet: one row per policy version an actor loaded (issue 40).
# fetch_s: the download (and a delta's application), overlapped with generation; drain_s +
# load_s: the engine's pause, during which no new reply starts.
LOADS_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string()),
        pa.field("version", pa.int64()),
        pa.field("fetch_s", pa.float64()),
        pa.field("drain_s", pa.float64()),
        pa.field("load_s", pa.float64()),
        pa.field("loaded_at", pa.timestamp("us", tz="UTC")),
    ]
)


def check_loads(found: pa.Schema) -> None:
    """Raise ValueError unless a loads file's schema `found` has every column of
    LOADS_SCHEMA, of its type: a file with other columns would read as rows of NULLs."""
    for field in LOADS_SCHEMA:
        if field.name not in found.names:
            raise ValueError(
                f"no column {field.name!r} (accepted: {', '.join(LOADS_SCHEMA.names)})"
            )
        if not found.field(field.name).type.equals(field.type):
            raise ValueError(f"column {field.name} has type {found.field(field.name).type}")


class LoadLog:
    """One actor process's record of the policy versions it loaded, in the store: one
    file of its own (its run id and a fresh id: no other writer names it), committed
    again whole after each load, so a reader sees every load so far or the file before."""

    def __init__(self, store, run_id: str) -> None:

        self.store, self.run_id = store, run_id
        self.path = layout.loads(store.root, run_id, layout.new_id())
        self.rows: list[dict] = []

    def add(self, version: int, fetch_s: float, drain_s: float, load_s: float) -> None:
        self.rows.append(
            {
                "run_id": self.run_id,
                "version": version,
                "fetch_s": fetch_s,
                "drain_s": drain_s,
                "load_s": load_s,
                "loaded_at": datetime.now(UTC),
            }
        )
        table = pa.Table.from_pylist(self.rows, schema=LOADS_SCHEMA)
        self.store.write_parquet(table, self.path, {})

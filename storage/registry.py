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

import pyarrow as pa

from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError, is_disk_full
from gagpo.storage import delta
from gagpo.storage.files import TEMP_PREFIX


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

    def latest(self) -> int | None:
        """The newest complete policy version, or None before the first publication."""
        path = layout.latest(self.store.root)
        try:
            raw = self.store.read_bytes(path)
        except FileNotFoundError:
            return None
        text = raw.decode(errors="replace").strip()
        try:
            return int(text)
        except ValueError:
            raise GagpoError(
                f"{path} holds {text!r}; accepted: a version number such as 7"
            ) from None

    def set_latest(self, version: int) -> None:
        """Point LATEST at `version`; call only once that version is complete."""
        self.store.commit_bytes(layout.latest(self.store.root), f"{version}\n".encode())

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
        """The version a delta version was taken against; None for a full version."""
        try:
            raw = self.store.read_bytes(layout.delta(self.dir(version)))
        except FileNotFoundError:
            return None
        return int(json.loads(raw)["base"])

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
        other is a copy under `cache_dir`, made once. A delta version is applied there to
        its base, fetched the same way: an actor holding the previous version downloads the
        delta alone, any other reader the nearest full version and the deltas after it."""
        remote = self.dir(version)
        if self.store.is_local and not self.is_delta(version):
            return remote
        local = os.path.join(cache_dir, _safe_name(self.store.url), f"v{version}")
        if not os.path.exists(layout.complete(local)):
            # Built beside the cache folder and renamed into place whole: a reader (another
            # actor, or this one after a kill) never sees a partial or unapplied version.
            staging = f"{local}.{uuid.uuid4().hex}.partial"
            try:
                self.store.download(remote, staging)
                if not os.path.exists(layout.complete(staging)):  # pruned meanwhile
                    raise FileNotFoundError(f"{remote} is not a complete policy version")
                record = delta.read_record(staging)
                if record is not None:
                    delta.apply_folder(staging, self.fetch(int(record["base"]), cache_dir))
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            os.makedirs(os.path.dirname(local), exist_ok=True)
            try:
                os.replace(staging, local)
            except OSError:  # another process finished first: its copy is the same
                shutil.rmtree(staging, ignore_errors=True)
        return local


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


def is_published(version: int, latest: int | None, stored: bool) -> bool:
    """Whether `version` was published: LATEST (`latest`, None before the learner's first
    publication) has reached it, or it is the base policy v0 and `stored`."""
    return (latest is not None and version <= latest) or (version == 0 and stored)


def _safe_name(url: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in url)

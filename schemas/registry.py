"""The policy registry of a store: the published versions `policy/v<N>/` and the
`policy/LATEST` pointer (docs/design.md §4), built on the store's file layer
(schemas/store.py) and named by schemas/layout.py. Reached as `store.policies`.

A version folder is loadable once its `.complete` marker exists, and LATEST only ever
names such a folder: the learner writes a version, marks it, then moves LATEST (learner/
publish.py); the actors publish the base policy as v0 without moving LATEST.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shutil
import uuid
from functools import partial

from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.files import TEMP_PREFIX
from gagpo.schemas.retry import is_disk_full


class PolicyRegistry:
    """The policy versions of `store` (a schemas/store.py `Store`, which imports this
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

    def fetch(self, version: int, cache_dir: str) -> str:
        """A local folder holding version `version` (the folder itself for a local store;
        else a copy under `cache_dir`, downloaded once)."""
        remote = self.dir(version)
        if self.store.is_local:
            return remote
        local = os.path.join(cache_dir, _safe_name(self.store.url), f"v{version}")
        if not os.path.exists(layout.complete(local)):
            staging = f"{local}.{uuid.uuid4().hex}.partial"
            self.store.download(remote, staging)
            open(layout.complete(staging), "w").close()
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with contextlib.suppress(OSError):  # another process finished first
                os.replace(staging, local)
        return local


def _safe_name(url: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in url)

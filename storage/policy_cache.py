"""The local cache of policy versions: whole copies of a store's versions, on this machine.

    <cache_dir>/<store url, made a file name>/v<N>/                 a version, whole
    <cache_dir>/<store url, made a file name>/v<N>.<hex>.partial/   a copy being built

A version is copied here when it cannot be read in place: every version of an object
store, and a delta version of any store (storage/delta.py), applied here to its base. A
copy is built in its `.partial` staging folder (downloaded, a delta applied) and renamed
into place whole, so a reader (another actor, or this one after a kill) never sees a
partial or unapplied version (`build`).

The cache is bounded (`sweep`, run by the actors' prefetcher after each version it
fetches): versions older than the newest few are removed, and so are the staging folders
of fetches that were cut (a kill, a failed download) once nobody has written into them
for STAGING_MAX_AGE_S. v0, the base policy, is kept: a learner starting on this machine
reads it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gagpo.schemas import layout

PARTIAL = ".partial"
STAGING_MAX_AGE_S = 3600.0  # a live fetch writes into its staging folder all the time
KEEP_VERSIONS = 2  # the newest versions a sweep keeps (the one loaded, the one before)
_VERSION_COPY = re.compile(r"^v(0|[1-9][0-9]*)$")
_STAGING = re.compile(r"^v(0|[1-9][0-9]*)\.[0-9a-f]{32}\.partial$")


@dataclass(frozen=True)
class Swept:
    """What one sweep removed: version copies and staging folders, and their bytes."""

    versions: tuple[int, ...]
    staging: int
    bytes: int

    def line(self) -> str:
        """One line for the actor's log ('' when nothing was removed)."""
        if not self.versions and not self.staging:
            return ""
        parts = []
        if self.versions:
            parts.append("v" + ", v".join(str(v) for v in self.versions))
        if self.staging:
            parts.append(f"{self.staging} staging folder(s) of cut fetches")
        return f"policy cache: removed {' and '.join(parts)}, {self.bytes / 2**20:.1f} MiB"


def _safe_name(url: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in url)


class VersionCache:
    """The cached copies of one store's versions under `cache_dir`."""

    def __init__(self, cache_dir: str | Path, url: str) -> None:
        self.folder = Path(cache_dir) / _safe_name(url)

    @classmethod
    def at(cls, folder: str | Path) -> VersionCache:
        """The cache whose copies are in `folder` (a fetched copy's parent)."""
        cache = cls.__new__(cls)
        cache.folder = Path(folder)
        return cache

    def path(self, version: int) -> Path:
        return self.folder / f"v{version}"

    def whole(self, version: int) -> Path | None:
        """The copy of `version`, when one is here whole (its `.complete` marker in)."""
        path = self.path(version)
        return path if os.path.exists(layout.complete(str(path))) else None

    def build(self, version: int, make: Callable[[str], None]) -> Path:
        """The copy of `version`: `make(staging)` fills a fresh staging folder, which is
        then renamed into place whole; on any failure it is removed. When another process
        renamed its copy first, that one is kept (the same version, the same bytes)."""
        final = self.path(version)
        staging = f"{final}.{uuid.uuid4().hex}{PARTIAL}"
        try:
            make(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(staging, final)
        except OSError:  # another process finished first: its copy is the same
            shutil.rmtree(staging, ignore_errors=True)
        return final

    def sweep(
        self,
        newest: int,
        *,
        keep: int = KEEP_VERSIONS,
        max_age_s: float = STAGING_MAX_AGE_S,
    ) -> Swept:
        """Remove the copies of versions below the newest `keep` up to `newest` (the
        version just fetched; newer ones, fetched by another process, stay), v0 apart, and
        the staging folders untouched for `max_age_s`. Best effort: a folder another
        process removes first is no error."""
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return Swept((), 0, 0)
        copies = sorted(
            int(m.group(1)) for e in entries if (m := _VERSION_COPY.match(e.name)) and e.is_dir()
        )
        kept = {v for v in copies if v > newest} | {0}
        kept |= set([v for v in copies if v <= newest][-keep:])
        removed, staging, size = [], 0, 0
        now = time.time()
        for entry in entries:
            if entry.is_symlink():
                continue  # not ours: the cache writes folders only
            match = _VERSION_COPY.match(entry.name)
            if match and entry.is_dir() and int(match.group(1)) not in kept:
                size += _remove(entry.path)
                removed.append(int(match.group(1)))
            elif _STAGING.match(entry.name) and now - _last_write(entry.path) > max_age_s:
                size += _remove(entry.path)
                staging += 1
        return Swept(tuple(sorted(removed)), staging, size)


def _last_write(path: str) -> float:
    """The newest modification time of folder `path` and the files in it."""
    try:
        newest = os.stat(path, follow_symlinks=False).st_mtime
    except OSError:  # removed meanwhile: nothing to sweep
        return time.time()
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
            except OSError:
                continue
    return newest


def _remove(path: str) -> int:
    """Remove folder `path`; return the bytes its files held."""
    size = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                size += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    shutil.rmtree(path, ignore_errors=True)
    return size

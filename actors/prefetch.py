"""Fetch the next policy version in the background while the engine generates (issue 40).

When `policy/LATEST` moves, a thread downloads the new version into the local cache
(`store.policies.fetch`, whose reads take the store's bounded retry path and whose cache
folder appears whole, by one rename, once every file is local). The actor goes on
generating with the version it holds and drains and reloads only once `ready` hands it the
local folder: the engine's pause is the drain and the load, never the download.

A local store's full version folder is used where it is (there is nothing to download),
so it is handed out at the poll that finds it; a delta version (storage/delta.py) is
applied into the cache in the background, as a download would be. One download at a time. If LATEST moves again during a download, the newer version is
fetched next, once this one is done; the version handed out is always the newest one that
is local. A failed download is said in one line and started again at the next poll.
Each version loaded is recorded in the store (`record`), for `gagpo sql`'s policy_loads.

The cache stays bounded: after each version it fetches, the thread sweeps the cache
(storage/policy_cache.py `VersionCache.sweep`): copies older than the newest two go, and so
do the staging folders of cut fetches; what was removed, and its size, is one line.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

from gagpo.schemas.errors import GagpoError, first_line
from gagpo.storage.background import Background
from gagpo.storage.policy_cache import Swept, VersionCache
from gagpo.storage.registry import LoadLog


@dataclass(frozen=True)
class Fetched:
    """A policy version whose files are local: its folder, the download's seconds, and
    what the cache's sweep after it removed."""

    version: int
    folder: Path
    seconds: float
    swept: Swept | None = None


class Prefetcher:
    """The background download of the newest version LATEST names; polled by the actor.
    One download at a time, in a daemon thread (storage/background.py): a download still
    running when the actor exits must not hold the process, and its staging folder is
    never named as the version (registry.fetch)."""

    def __init__(self, store, cache_dir: str, warn) -> None:
        self._store, self._cache_dir, self._warn = store, cache_dir, warn
        self._job = Background(daemon=True)
        self._version: int | None = None  # the version of the download handed to `_job`
        self._log: LoadLog | None = None  # created at the first load

    def ready(self, held: int) -> Fetched | None:
        """A local version newer than `held` to load now, or None. Starts a download when
        LATEST names a version newer than `held` and than the one just fetched, and none
        is running."""
        fetched = self._harvest(self._job.poll)
        if fetched is not None and fetched.version <= held:
            fetched = None
        if not self._job.pending:
            newest = fetched.version if fetched is not None else held
            latest = self._store.policies.latest()
            if latest is not None and latest > newest:
                self._version = latest
                self._job.submit(functools.partial(self._fetch, latest), name=f"fetch-v{latest}")
                # A local store's full version is its own folder: nothing to download. A
                # delta version is applied in the background like a download.
                if self._store.is_local and not self._store.policies.is_delta(latest):
                    fetched = self._harvest(self._job.wait) or fetched
        return fetched

    def record(self, load, run_id: str) -> None:
        """Commit `load` (actors/actor.py `VersionLoad`) to the store's load records
        (storage/registry.py `LoadLog`: this process's own file), read by `gagpo sql`'s
        `policy_loads`. A record that cannot be committed is one warning line: the actor
        goes on generating."""
        if self._log is None:
            self._log = LoadLog(self._store, run_id)
        try:
            self._log.add(load.version, load.fetch_s, load.drain_s, load.load_s)
        except (OSError, GagpoError) as exc:
            self._warn(f"recording the load of policy v{load.version} failed ({first_line(exc)})")

    def _fetch(self, version: int) -> Fetched:
        t0 = time.perf_counter()
        if not self._store.policies.has(version):  # pruned (a local fetch would not say)
            raise FileNotFoundError(self._store.policies.dir(version))
        folder = Path(self._store.policies.fetch(version, self._cache_dir))
        seconds = time.perf_counter() - t0
        swept = None
        if folder.parent.parent == Path(self._cache_dir):  # a copy: the cache has grown
            swept = VersionCache.at(folder.parent).sweep(version)
        return Fetched(version, folder, seconds, swept)

    def _harvest(self, take) -> Fetched | None:
        """The download's result as `take` (`_job.poll` or `_job.wait`) hands it over: None
        while one runs, when none ended, or when it failed (said in one line, unless the
        version was pruned: LATEST is read again at the next poll)."""
        version = self._version
        try:
            fetched = take()
        except Exception as exc:
            if isinstance(exc, FileNotFoundError) and not self._store.policies.has(version):
                return None  # pruned by the learner before we read it
            self._warn(f"fetching policy v{version} failed ({exc}); retrying at the next poll")
            return None
        if fetched is not None and fetched.swept is not None and fetched.swept.line():
            self._warn(fetched.swept.line())
        return fetched

"""Issue 40, the actor side: a new policy version is downloaded while the engine generates,
the engine pauses only to drain and load it, and each load's fetch seconds and pause are
recorded (actors/prefetch.py, actors/actor.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gagpo.actors.prefetch import Prefetcher
from gagpo.schemas.cache import policy_cache_dir
from gagpo.storage.policy_cache import _safe_name
from gagpo.storage.registry import PolicyRegistry
from gagpo.storage.store import Store
from tests.helpers.actors import actor_config
from tests.helpers.versions import perturbed_copy

SOKOBAN = {"sizes": [5, 5], "max_boxes": 1}
FETCH_FLOOR_S = 2.0  # the slowed download of v1 lasts at least this long


def _publish(store: Store, base: Path, version: int, tmp: Path) -> None:
    """Publish a perturbed copy of `base` as `version` and move LATEST to it."""
    from gagpo.learner.publish import put_folder

    local = tmp / f"v{version}"
    perturbed_copy(base, local)
    (local / ".complete").unlink()  # put_folder commits the marker last
    put_folder(store, local, store.policies.dir(version), phase="publish")
    store.policies.set_latest(version)


def test_versions_are_fetched_while_generating(s3_endpoint, tmp_path: Path, monkeypatch):
    """v1 is published while the actor runs, on an object store; its download is held open
    until the actor has finished two more groups (impossible if the engine waited for it),
    and v2 appears during that download. Both are loaded, in order, each with its fetch
    seconds and an engine pause that excludes the download."""
    from gagpo.actors.actor import run_actor
    from gagpo.actors.policies.presets import tiny_dir

    url = f"s3://gagpo/{tmp_path.name}"
    store = Store(url, skip_instance_cache=True)
    base = tiny_dir()
    done_groups = [0]
    during_fetch = threading.Event()
    window: dict[str, float] = {}
    original = PolicyRegistry.fetch

    fetched = {1: threading.Event(), 2: threading.Event()}

    def slow_fetch(self, version, cache_dir):
        if version == 1:
            window["start"], window["groups"] = time.perf_counter(), done_groups[0]
            window["progressed"] = during_fetch.wait(timeout=120)
            time.sleep(max(0.0, FETCH_FLOOR_S - (time.perf_counter() - window["start"])))
            _publish(store, base, 2, tmp_path)  # LATEST moves during the download
            window["end"] = time.perf_counter()
        window[f"fetching {version}"] = True
        try:
            return original(self, version, cache_dir)
        finally:
            fetched[version].set()

    def progress(summary) -> None:
        done_groups[0] = summary.groups
        if summary.groups == 1 and "published" not in window:
            window["published"] = True
            _publish(store, base, 1, tmp_path)
        if "groups" in window and summary.groups >= window["groups"] + 2:
            during_fetch.set()  # two groups ended during the download: generation went on
            # Then, so that groups remain to poll at whatever speed this machine plays
            # them, the actor waits for each download it started (never before: the
            # point is that it did not wait for v1 while it generated).
            fetched[1].wait(timeout=60)
            if "fetching 2" in window:
                fetched[2].wait(timeout=60)

    monkeypatch.setattr(PolicyRegistry, "fetch", slow_fetch)
    warnings: list[str] = []
    config = actor_config(url, "sokoban", groups=10, group_size=2, max_turns=2, env_options=SOKOBAN)
    summary = run_actor(config, progress=progress, warn=warnings.append)

    assert warnings == []
    assert window["progressed"], "no group finished while v1 was being downloaded"
    assert [load.version for load in summary.loads] == [1, 2]
    assert {0, 1, 2} <= summary.versions
    first = summary.loads[0]
    assert first.fetch_s >= window["end"] - window["start"] >= FETCH_FLOOR_S
    for load in summary.loads:
        assert load.fetch_s > 0 and load.load_s > 0 and load.drain_s >= 0
        assert load.pause_s == pytest.approx(load.drain_s + load.load_s)
    # The pause is the drain and the load: the held-open download is not in it.
    assert first.pause_s < FETCH_FLOOR_S
    cache = policy_cache_dir() / _safe_name(url)
    assert sorted(p.name for p in cache.iterdir()) == ["v1", "v2"]  # no staging folder left


def test_the_loads_are_on_the_progress_and_closing_lines(capsys):
    from gagpo.actors.actor import ActorSummary, VersionLoad
    from gagpo.actors.cli import _print_summary, _progress_printer

    summary = ActorSummary(run_id="r", groups=3, versions={0, 4})
    summary.loads += [VersionLoad(2, 7.5, 0.0, 1.25), VersionLoad(4, 3.0, 0.5, 1.0)]
    _, update = _progress_printer(None)
    update(summary)  # not a terminal: one plain line per update
    assert "v4 fetch 3.0s pause 1.5s" in capsys.readouterr().err
    _print_summary(summary, "store")
    out = capsys.readouterr().out
    assert "v2 fetch 7.5s pause 1.25s, v4 fetch 3.0s pause 1.50s" in out


class _FakeRegistry:
    """LATEST and a download per version that a test controls; it records which downloads
    started, which ended, and how many ran at once."""

    def __init__(self) -> None:
        self.latest_version: int | None = None
        self.gates: dict[int, threading.Event] = {}
        self.failures: dict[int, int] = {}
        self.started: list[int] = []
        self.fetched: list[int] = []
        self.running = self.most_at_once = 0
        self._lock = threading.Lock()

    def latest(self):
        return self.latest_version

    def has(self, version: int) -> bool:
        return self.latest_version is not None and version <= self.latest_version

    def dir(self, version: int) -> str:
        return f"policy/v{version}"

    def gate(self, version: int) -> threading.Event:
        """Set to let version `version`'s download finish."""
        return self.gates.setdefault(version, threading.Event())

    def fetch(self, version: int, cache_dir: str) -> str:
        with self._lock:
            self.started.append(version)
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            self.gate(version).wait(timeout=30)
            if self.failures.get(version, 0):
                self.failures[version] -= 1
                raise OSError("connection reset")
            self.fetched.append(version)
            return f"{cache_dir}/v{version}"
        finally:
            with self._lock:
                self.running -= 1


def _prefetcher() -> tuple[Prefetcher, _FakeRegistry, list[str]]:
    registry, warnings = _FakeRegistry(), []
    store = SimpleNamespace(policies=registry, is_local=False)
    return Prefetcher(store, "cache", warnings.append), registry, warnings


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.01)


def _poll(prefetch: Prefetcher, held: int):
    """What the actor's polls get once the download in flight has ended."""
    found: list = []
    _until(lambda: found.append(prefetch.ready(held)) or found[-1] is not None, "ready")
    return found[-1]


def test_a_newer_version_during_a_download_is_fetched_next():
    prefetch, registry, _ = _prefetcher()
    registry.latest_version = 1
    assert prefetch.ready(0) is None
    _until(lambda: registry.started == [1], "started v1")
    registry.latest_version = 2  # LATEST moves while v1 downloads
    assert prefetch.ready(0) is None  # v1 is not done, and v2 waits for it
    time.sleep(0.2)  # room for a second download, were one started
    assert registry.started == [1]  # one download at a time
    registry.gate(1).set()
    fetched = _poll(prefetch, 0)
    assert fetched.version == 1  # the newest local version
    _until(lambda: registry.started == [1, 2], "started v2")  # the newer one is on its way
    registry.gate(2).set()
    assert _poll(prefetch, 1).version == 2
    assert prefetch.ready(2) is None
    time.sleep(0.2)
    assert registry.fetched == [1, 2] and registry.started == [1, 2]  # nothing newer to fetch
    assert registry.most_at_once == 1


def test_a_finished_download_older_than_the_held_version_is_dropped():
    prefetch, registry, _ = _prefetcher()
    registry.latest_version = 1
    registry.gate(1).set()
    assert prefetch.ready(0) is None
    _until(lambda: registry.fetched == [1], "fetched v1")
    registry.latest_version = 2
    registry.gate(2).set()
    # The actor holds v1 already (the polls say so): v1 is never handed out, v2 is.
    assert _poll(prefetch, 1).version == 2
    assert registry.fetched == [1, 2]


def test_a_failed_download_is_one_line_and_retried():
    prefetch, registry, warnings = _prefetcher()
    registry.latest_version, registry.failures[3] = 3, 1
    registry.gate(3).set()
    # The poll that takes the failure says it and starts the retry (so it returns None).
    _until(lambda: prefetch.ready(0) is None and warnings, "harvested the failure")
    assert warnings == ["fetching policy v3 failed (connection reset); retrying at the next poll"]
    assert _poll(prefetch, 0).version == 3  # the retry, started by the poll that said it
    assert registry.started == [3, 3] and registry.fetched == [3]


def test_a_failed_download_leaves_nothing_in_the_cache(s3_endpoint, tmp_path: Path, monkeypatch):
    """A download that breaks midway leaves no version folder and no staging folder."""
    store = Store(f"s3://gagpo/{tmp_path.name}-partial")
    store.commit_bytes(f"{store.policies.dir(1)}/model.safetensors", b"x" * 100)
    store.commit_bytes(f"{store.policies.dir(1)}/.complete", b"{}")

    def broken(remote, local):
        Path(local).mkdir(parents=True)
        (Path(local) / "model.safetensors").write_bytes(b"x")
        raise OSError("connection reset")

    monkeypatch.setattr(store, "download", broken)
    cache = tmp_path / "cache"
    with pytest.raises(OSError):
        store.policies.fetch(1, str(cache))
    assert [p for p in cache.rglob("*") if p.is_file() or "v1" in p.name] == []
    monkeypatch.undo()
    assert Path(store.policies.fetch(1, str(cache)), "model.safetensors").stat().st_size == 100

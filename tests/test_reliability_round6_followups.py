"""Issue 46 (reliability round 6), what its first pass left: a run longer than the versions
a store can name is refused at config time, and the held-out evaluation's fetched copies of
published versions are swept as the actors' are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from gagpo.actors.config import ActorConfig
from gagpo.learner.config import LearnerConfig
from gagpo.schemas import layout
from gagpo.schemas.layout import COMPLETE
from gagpo.storage.policy_cache import VersionCache
from gagpo.storage.store import Store
from gagpo.workflows import evaluate

CLI = (sys.executable, "-m", "gagpo.learner.cli")
LAST = layout.MAX_VERSION - 1  # 9,999,999: `v9999999` is the last name the layout accepts


# --- learner.updates stops at the last nameable version --------------------------------------
def test_updates_beyond_the_last_nameable_version_are_refused_at_config_time():
    """Each update publishes one version; version names stop at 9,999,999 (schemas/layout.py).
    Before: `updates` accepted up to 10**9, and the run would fail at update 10,000,000."""
    assert LearnerConfig(store="s", updates=LAST).updates == LAST
    for updates in (LAST + 1, 10**9):
        with pytest.raises(ValidationError) as refused:
            LearnerConfig(store="s", updates=updates)
        text = str(refused.value.errors()[0]["msg"])
        assert f"past v{LAST}" in text and f"accepted: 1 to {LAST}" in text, text


def test_gagpo_learner_refuses_too_many_updates_in_one_line(tmp_path: Path):
    done = subprocess.run(
        [*CLI, "--store", str(tmp_path / "s"), "--updates", str(10**9)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "'updates'" in lines[0] and f"accepted: 1 to {LAST}" in lines[0], lines[0]
    assert not (tmp_path / "s").exists()  # refused before anything was created


# --- the evaluation's copies are swept ------------------------------------------------------------
def publish_versions(store: Store, count: int) -> None:
    for version in range(count):
        folder = store.policies.dir(version)
        store.commit_bytes(f"{folder}/model.safetensors", b"w" * 4096)
        store.commit_bytes(f"{folder}/{COMPLETE}", b"{}")
    store.policies.set_latest(count - 1)


def test_evaluating_every_version_of_an_object_store_keeps_a_bounded_cache(
    tmp_path: Path, monkeypatch, capsys
):
    """`gagpo run`'s held-out evaluation fetches each kept version of an object store into
    the local policy cache (memory:// here) and plays it. Before: every version stayed
    there (about 15 GB a version at 7B); now the cache is swept after each version as the
    actors' prefetcher sweeps it: v0 and the newest two are left, and each sweep says what
    it removed."""
    store = Store(f"memory://round6-eval-{tmp_path.name}")
    publish_versions(store, 7)
    monkeypatch.setenv("GAGPO_CACHE", str(tmp_path / "cache"))
    played: list[str] = []
    monkeypatch.setattr(
        evaluate,
        "play",
        lambda actors: (
            played.append(actors.policy)
            or {"rollouts": 1, "success_rate": 0.0, "valid_rate": 0.0, "mean_return": 0.0}
        ),
    )
    rows = evaluate.evaluate_run(
        store, ActorConfig(store="x"), groups=1, every=1, seed=7, echo=lambda _: None
    )
    assert [row["policy_version"] for row in rows] == list(range(7))
    assert all(Path(p).is_relative_to(tmp_path / "cache" / "policies") for p in played)
    folder = VersionCache(tmp_path / "cache" / "policies", store.url).folder
    assert sorted(p.name for p in folder.iterdir()) == ["v0", "v5", "v6"]
    out = capsys.readouterr().out
    assert "policy cache: removed v" in out and "MiB" in out, out


def test_the_evaluation_never_sweeps_a_local_stores_own_versions(tmp_path: Path, monkeypatch):
    """A full version of a local store is played in place (its own folder): the sweep must
    leave it, and every other version of the store, where it is."""
    store = Store(str(tmp_path / "store"))
    publish_versions(store, 5)
    monkeypatch.setenv("GAGPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(evaluate, "play", lambda actors: {})
    for version in range(5):
        evaluate.evaluate_version(store, version, ActorConfig(store="x"), groups=1, seed=7)
    assert store.policies.stored() == list(range(5))
    assert all((tmp_path / "store" / "policy" / f"v{v}" / COMPLETE).is_file() for v in range(5))

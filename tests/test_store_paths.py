"""Store paths are paths (issue 33): a store whose root holds `[`, `]`, `*` or `?` sees its
own data, in every command, and nothing of the store beside it whose name the root would
match as a glob pattern (runs/glob[1]*?store matches runs/glob1xystore).

fsspec reads those characters as wildcards in glob, and in rm, get and mv on object
stores (they expand their arguments); `Store` takes its root literally everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gagpo.inspection.sql import query_store
from gagpo.learner.config import LearnerConfig
from gagpo.learner.feed import Ledger
from gagpo.learner.state import state_versions
from gagpo.learner.train import train
from gagpo.pipeline.config import GagpoConfig
from gagpo.pipeline.recompute import recompute_store
from gagpo.storage.archive import read_manifest, read_steps_table
from gagpo.storage.compaction import compact
from gagpo.storage.store import Store
from tests.helpers.learner import tiny_model_dir, write_shards
from tests.helpers.steps import make_steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAME = "glob[1]*?store"  # every glob character fsspec knows
SIBLING = "glob1xystore"  # what NAME matches when read as a pattern
_BIN = Path(sys.executable).parent / "gagpo"
GAGPO = [str(_BIN)] if _BIN.exists() else [sys.executable, "-m", "gagpo.workflows.cli"]


@pytest.fixture(params=["local", "s3"])
def stores(request, tmp_path) -> tuple[Store, Store]:
    """A store named NAME and, beside it, a store named SIBLING."""
    if request.param == "local":
        return Store(str(tmp_path / NAME)), Store(str(tmp_path / SIBLING))
    endpoint = request.getfixturevalue("s3_endpoint")
    options = {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
    base = f"s3://gagpo/{tmp_path.name}"
    return Store(f"{base}/{NAME}", **options), Store(f"{base}/{SIBLING}", **options)


def _shard(store: Store, shard_id: str, run_id: str = "r") -> str:
    return store.write_shard(make_steps(run_id=run_id, shard_id=shard_id), group_size=3).path


def test_listings_see_the_store_and_not_its_sibling(stores):
    store, sibling = stores
    _shard(store, "a1", "r1"), _shard(store, "a2", "r2")
    _shard(sibling, "a1", "r1")  # the same names: an unescaped pattern would list it
    assert [(r.run_id, r.shard_id) for r in store.list_shards()] == [("r1", "a1"), ("r2", "a2")]
    assert [r.shard_id for r in store.list_shards("r2")] == ["a2"]
    assert [r.path for r in sibling.list_shards()] == [sibling.shard_path("r1", "a1")]
    for version in (0, 3):
        store.commit_bytes(f"{store.policies.dir(version)}/.complete", b"{}")
    assert store.policies.folders() == [0, 3] and sibling.policies.folders() == []
    assert read_steps_table(store).num_rows == 2 * make_steps().num_rows


def test_sql_and_advantages_see_the_data(stores):
    store, sibling = stores
    _shard(store, "a1"), _shard(store, "a2")
    _shard(sibling, "a1")
    steps = 2 * make_steps().num_rows
    assert query_store(store, "SELECT count(*) AS n FROM steps").to_pylist() == [{"n": steps}]
    summary = recompute_store(store.url, None, GagpoConfig())
    assert summary.shards == 2 and not summary.quarantined
    got = query_store(store, "SELECT count(*) AS n FROM advantages").to_pylist()
    assert got == [{"n": steps}]
    assert query_store(sibling, "SELECT count(*) AS n FROM advantages").to_pylist() == [{"n": 0}]


def test_removal_moves_and_downloads_touch_only_the_store(stores, tmp_path):
    store, sibling = stores
    for s in (store, sibling):
        for name in ("a.txt", "b.txt"):
            s.commit_bytes(f"{s.policies.dir(1)}/{name}", name.encode())
    store.download(store.policies.dir(1), str(tmp_path / "got"))
    assert sorted(os.listdir(tmp_path / "got")) == ["a.txt", "b.txt"]
    store.remove(store.policies.dir(1), recursive=True)
    assert not store.exists(f"{store.policies.dir(1)}/a.txt")
    assert sibling.exists(f"{sibling.policies.dir(1)}/a.txt")

    paths = [_shard(store, "q1"), _shard(store, "q2")]
    sibling_paths = [_shard(sibling, "q1"), _shard(sibling, "q2")]
    moved = store.quarantine(paths[0], "a test")
    assert store.exists(moved) and not store.exists(paths[0])
    assert [q["original_path"] for q in store.quarantined()] == [paths[0]]
    store.remove_files(paths[1:], "a test's files")
    assert store.list_shards() == [] and all(sibling.exists(p) for p in sibling_paths)


def test_compaction_on_a_store_named_like_a_pattern(stores):
    store, sibling = stores
    for i in range(3):
        _shard(store, f"s{i}")
    _shard(sibling, "s0")
    before = read_steps_table(store).num_rows
    result = compact(store, store.list_shards(), None)
    assert result.shards == 3 and store.list_shards() == []
    assert read_manifest(store).generation == 1 and read_manifest(sibling) is None
    assert read_steps_table(store).num_rows == before
    assert [r.shard_id for r in sibling.list_shards()] == ["s0"]


def test_learner_reads_publishes_and_resumes(stores):
    store, sibling = stores
    write_shards(store, 3)
    write_shards(sibling, 1)
    cfg = dict(
        store=store.url,
        policy=str(tiny_model_dir()),
        batch_groups=2,
        keep_versions=1,
        keep_checkpoints=1,
        idle_timeout_s=0.5,
        poll_interval_s=0.05,
    )
    assert train(LearnerConfig(**cfg, updates=2)).updates == 2
    assert train(LearnerConfig(**cfg, updates=3, resume=True)).updates == 3
    assert store.policies.latest() == 3
    assert store.policies.folders()[-1:] == [3] and state_versions(store) == [3]  # the rest pruned
    assert not {1, 2} & set(store.policies.folders())
    assert len(Ledger.load(store).rows) == 6
    assert sibling.policies.latest() is None and len(sibling.list_shards()) == 1


def _gagpo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*GAGPO, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_every_command_sees_the_data(tmp_path: Path):
    root = tmp_path / NAME
    url = str(root)
    actors = [
        sys.executable,
        "-m",
        "gagpo.actors.cli",
        "--quiet",
        "--store",
        url,
        "--env",
        "sokoban",
        "--policy",
        "tiny",
        "--groups",
        "4",
        "--group-size",
        "3",
        "--max-turns",
        "4",
        "--seed",
        "1",
    ]
    done = subprocess.run(actors, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    store = Store(url)
    steps = read_steps_table(store).num_rows
    assert len(store.list_shards()) == 4 and steps > 0

    def count() -> int:
        done = _gagpo("sql", "--store", url, "--format", "json", "SELECT count(*) AS n FROM steps")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)[0]["n"]

    assert count() == steps
    done = _gagpo("advantages", "--store", url)
    assert done.returncode == 0, done.stderr
    assert f"4 shard table(s), {steps} steps" in done.stdout
    done = _gagpo("report", "--store", url, "--out", str(tmp_path / "report"))
    assert done.returncode == 0, done.stderr
    assert "no steps yet" not in (tmp_path / "report" / "summary.md").read_text()
    done = _gagpo("compact", "--store", url, "--all")
    assert done.returncode == 0, done.stderr
    assert "compaction 1: 4 shard(s)" in done.stdout and "not released" not in done.stdout
    assert store.list_shards() == [] and count() == steps

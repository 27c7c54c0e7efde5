"""`gagpo-actors` end to end: real processes writing real shards into a temporary store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from gagpo.schemas import columns as C
from gagpo.schemas.store import Store
from gagpo.schemas.validate import validate_steps

ACTORS = [sys.executable, "-m", "gagpo.actors.cli"]


def run_actors(
    *args: str, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*ACTORS, "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("env_name", ["sokoban", "household"])
def test_actors_write_valid_grouped_shards(store_dir: Path, env_name: str):
    G = 4
    result = run_actors(
        "--store",
        str(store_dir),
        "--env",
        env_name,
        "--policy",
        "tiny",
        "--groups",
        "3",
        "--group-size",
        str(G),
        "--max-turns",
        "6",
        "--seed",
        "11",
        "--groups-per-shard",
        "2",
    )
    assert result.returncode == 0, result.stderr
    assert "3 groups, 12 rollouts" in result.stdout
    store = Store(str(store_dir))
    refs = store.list_shards()
    assert len(refs) == 2  # 2 groups + 1 group

    for ref in refs:
        # pyarrow reads the file as it is, metadata included, and it satisfies the contract.
        table = pq.read_table(ref.path)
        validate_steps(table, table.schema.metadata)
        assert table.schema.metadata[C.META_GROUP_SIZE] == str(G).encode()

    # Polars and DuckDB read the shards as they are.
    glob = str(store_dir / "shards" / "run=*" / "*.parquet")
    steps = pl.read_parquet(glob)
    n_duck = duckdb.execute(f"select count(*) from read_parquet('{glob}')").fetchone()[0]
    assert steps.height == n_duck > 0
    assert steps[C.ENV].unique().to_list() == [env_name]
    assert steps[C.POLICY_VERSION].unique().to_list() == [0]

    # G rollouts per group, all starting from the same state_key.
    first = (
        steps.filter(pl.col(C.STEP) == 0)
        .group_by(C.GROUP_ID)
        .agg(
            pl.col(C.TRAJ_ID).n_unique().alias("rollouts"),
            pl.col(C.STATE_KEY).n_unique().alias("starts"),
        )
    )
    assert first.height == 3
    assert first["rollouts"].to_list() == [G] * 3
    assert first["starts"].to_list() == [1] * 3

    # Rollouts meet identical states again: some later state is shared by several rollouts.
    shared_later = (
        steps.filter(pl.col(C.STEP) > 0)
        .group_by(C.GROUP_ID, C.STATE_KEY)
        .agg(pl.col(C.TRAJ_ID).n_unique().alias("n"))
        .filter(pl.col("n") > 1)
    )
    assert shared_later.height > 0

    # Contract details: token lists aligned, rewards finite, terminal rows have no next state.
    assert (steps[C.ACTION_IDS].list.len() == steps[C.BEHAVIOR_LOGPROBS].list.len()).all()
    assert (steps[C.ACTION_IDS].list.len() > 0).all()
    assert steps.filter(pl.col(C.DONE))[C.NEXT_STATE_KEY].null_count() == steps[C.DONE].sum()
    assert steps.filter(~pl.col(C.DONE))[C.NEXT_STATE_KEY].null_count() == 0
    assert (steps[C.BEHAVIOR_LOGPROBS].list.max() <= 0).all()


def test_two_actors_into_one_store_collide_on_nothing(store_dir: Path):
    common = [
        "--store",
        str(store_dir),
        "--env",
        "sokoban",
        "--policy",
        "tiny",
        "--groups",
        "3",
        "--group-size",
        "3",
        "--max-turns",
        "5",
    ]
    procs = [
        subprocess.Popen(
            [*ACTORS, "--quiet", *common, "--seed", str(seed), "--run-id", "shared"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    store = Store(str(store_dir))
    refs = store.list_shards("shared")
    assert len(refs) == 6 and len({r.shard_id for r in refs}) == 6
    steps = pl.concat([pl.from_arrow(store.read_shard(r)) for r in refs])
    assert steps[C.GROUP_ID].n_unique() == 6
    assert steps[C.TRAJ_ID].n_unique() == 18


_SLOW_COMMIT = """
import os, sys, time
import pyarrow as pa
from gagpo.schemas.store import Store
from tests.steps_factory import make_steps
real_fsync = os.fsync
def slow_fsync(fd):
    print("writing", flush=True)
    time.sleep(60)  # the test kills us here: data written, not yet renamed
    real_fsync(fd)
os.fsync = slow_fsync
Store(sys.argv[1]).write_shard(make_steps(shard_id="torn"), group_size=3)
"""


def test_sigkill_during_commit_leaves_nothing_visible(store_dir: Path):
    store = Store(str(store_dir))
    store.write_shard(
        __import__("tests.steps_factory").steps_factory.make_steps(shard_id="ok"), group_size=3
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_COMMIT, str(store_dir)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    leftovers = [p.name for p in (store_dir / "shards" / "run=run1").iterdir()]
    assert any(name.startswith(".tmp-") for name in leftovers)  # the torn bytes exist...
    assert [r.shard_id for r in store.list_shards()] == ["ok"]  # ...but no reader sees them
    assert all(store.read_shard(r).num_rows for r in store.list_shards())


def test_sigkill_of_running_actor_leaves_only_whole_shards(store_dir: Path):
    """Kill a real actor at several moments; every visible shard is complete and valid."""
    for delay in (2.0, 3.5, 5.0):
        proc = subprocess.Popen(
            [
                *ACTORS,
                "--quiet",
                "--store",
                str(store_dir),
                "--env",
                "household",
                "--policy",
                "tiny",
                "--follow",
                "--group-size",
                "2",
                "--max-turns",
                "3",
                "--seed",
                str(int(delay * 10)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    store = Store(str(store_dir))
    for ref in store.list_shards():
        store.read_shard(ref)  # raises if torn or incomplete
    assert store.quarantined() == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--group-size", "0"], "config field 'group_size'"),
        (["--env", "chess"], "unknown environment 'chess'; accepted:"),
        (["--policy", "/no/such/model"], "model path '/no/such/model' does not exist"),
        (["--device", "tpu"], "config field 'device'"),
    ],
    ids=["bad-config", "unknown-env", "missing-model", "bad-device"],
)
def test_bad_input_is_one_clear_line(store_dir: Path, args, message):
    base = {"--store": str(store_dir), "--env": "sokoban", "--policy": "tiny", "--groups": "1"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    result = run_actors(*[x for kv in base.items() for x in kv])
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert Store(str(store_dir)).list_shards() == []


def test_unwritable_store_and_bad_config_file(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run_actors("--store", str(blocker / "s"), "--env", "sokoban", "--groups", "1")
    assert result.returncode == 2 and "cannot be written" in result.stderr
    assert "Traceback" not in result.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[actors]\ngroup_size = 'eight'\n")
    result = run_actors("--config", str(bad), "--store", str(tmp_path / "s"))
    assert result.returncode == 2 and "config field 'group_size'" in result.stderr
    result = run_actors("--config", str(tmp_path / "missing.toml"), "--store", str(tmp_path / "s"))
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_actor_keeps_its_policy_when_latest_was_pruned(store_dir: Path):
    """LATEST names a version whose folder is gone (pruned before a slow actor read it)."""
    from types import SimpleNamespace

    from gagpo.actors.actor import _newest_policy
    from gagpo.schemas.config import ActorConfig

    store = Store(str(store_dir))
    store.set_latest(5)
    held = SimpleNamespace(version=0)
    config = ActorConfig(store=str(store_dir), env="sokoban")
    assert _newest_policy(store, held, config) is held

"""`gagpo-actors` end to end: real processes writing real shards into a temporary store."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from gagpo.envs.base import INVALID_ACTION_PENALTY
from gagpo.schemas import columns as C
from gagpo.schemas.validate import validate_steps
from gagpo.storage.store import Store
from tests.helpers.actors import actors_command, needs, run_actors
from tests.helpers.steps import make_steps


# What else an environment's shards show, beyond what every environment's do.
def meets_states_again(steps: pl.DataFrame) -> None:
    """Rollouts meet identical states again: some later state is shared by several rollouts."""
    shared_later = (
        steps.filter(pl.col(C.STEP) > 0)
        .group_by(C.GROUP_ID, C.STATE_KEY)
        .agg(pl.col(C.TRAJ_ID).n_unique().alias("n"))
        .filter(pl.col("n") > 1)
    )
    assert shared_later.height > 0


def starts_at_the_search_page(steps: pl.DataFrame) -> None:
    assert (steps.filter(pl.col(C.STEP) == 0)[C.STATE_KEY] == "search").all()


def rewards_are_outcomes_or_the_penalty(steps: pl.DataFrame) -> None:
    rewards = steps[C.REWARD].cast(pl.Float64).round(4)
    assert rewards.is_in([0.0, 1.0, INVALID_ACTION_PENALTY]).all()


def some_replies_are_invalid(steps: pl.DataFrame) -> None:
    """The tiny policy does not speak these games' move formats."""
    assert (~steps[C.ACTION_VALID]).sum() > 0


PER_SHARD = 2  # --groups-per-shard: 3 groups make a shard of 2 and one of 1
# env, groups, group size, its other options, what else its shards show
SHARD_CASES = [
    pytest.param(
        "sokoban", 3, 4, ["--max-turns", "6", "--seed", "11"], [meets_states_again], id="sokoban"
    ),
    pytest.param(
        "household",
        3,
        4,
        ["--max-turns", "6", "--seed", "11"],
        [meets_states_again],
        id="household",
    ),
    pytest.param(
        "webshop",
        2,
        3,
        ["--max-turns", "4", "--seed", "5"],
        [starts_at_the_search_page],
        id="webshop",
    ),
    pytest.param(
        "textworld",
        2,
        2,
        ["--max-turns", "3", "--seed", "3"],
        [],
        marks=[pytest.mark.slow, needs("textworld")],
        id="textworld",
    ),
    pytest.param(
        "alfworld",
        2,
        2,
        ["--max-turns", "3", "--seed", "3"],
        [rewards_are_outcomes_or_the_penalty],
        marks=[pytest.mark.slow, needs("alfworld", "textworld", "fast_downward")],
        id="alfworld",
    ),
    pytest.param(
        "textarena/TowerOfHanoi-v0",
        2,
        3,
        ["--max-turns", "4", "--seed", "3"],
        [some_replies_are_invalid],
        marks=[pytest.mark.slow, needs("textarena")],
        id="textarena",
    ),
    pytest.param(
        "gem/game:GuessTheNumber-v0-easy",
        2,
        3,
        ["--max-turns", "4", "--seed", "3"],
        [some_replies_are_invalid],
        marks=[pytest.mark.slow, needs("gem")],
        id="gem",
    ),
    pytest.param(
        "reasoning_gym/leg_counting",
        2,
        3,
        ["--max-turns", "4", "--seed", "3", "--set", "env_options.size=20"],
        [],
        marks=[pytest.mark.slow, needs("reasoning_gym")],
        id="reasoning_gym",
    ),
]


@pytest.mark.parametrize("env_name, groups, G, options, checks", SHARD_CASES)
def test_actors_write_valid_grouped_shards(store_dir: Path, env_name, groups, G, options, checks):
    result = run_actors(
        *("--store", str(store_dir), "--env", env_name, "--policy", "tiny"),
        *("--groups", str(groups), "--group-size", str(G), "--groups-per-shard", str(PER_SHARD)),
        *options,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{groups} groups, {groups * G} rollouts" in result.stdout
    store = Store(str(store_dir))
    refs = store.list_shards()
    assert len(refs) == -(-groups // PER_SHARD)

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
    assert first.height == groups
    assert first["rollouts"].to_list() == [G] * groups
    assert first["starts"].to_list() == [1] * groups
    assert steps[C.TRAJ_ID].n_unique() == groups * G

    # Contract details: token lists aligned, rewards finite, terminal rows have no next state.
    assert (steps[C.ACTION_IDS].list.len() == steps[C.BEHAVIOR_LOGPROBS].list.len()).all()
    assert (steps[C.ACTION_IDS].list.len() > 0).all()
    assert steps.filter(pl.col(C.DONE))[C.NEXT_STATE_KEY].null_count() == steps[C.DONE].sum()
    assert steps.filter(~pl.col(C.DONE))[C.NEXT_STATE_KEY].null_count() == 0
    assert (steps[C.BEHAVIOR_LOGPROBS].list.max() <= 0).all()
    assert steps.filter(pl.col(C.WON))[C.DONE].all()  # won only on a terminating step

    for check in checks:
        check(steps)


def test_two_actors_into_one_store_collide_on_nothing(store_dir: Path):
    common = {"env": "sokoban", "groups": 3, "group_size": 3, "max_turns": 5, "run_id": "shared"}
    procs = [
        subprocess.Popen(
            actors_command(store_dir, **common, seed=seed),
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
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps
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
    store.write_shard(make_steps(shard_id="ok"), group_size=3)
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
            actors_command(
                store_dir,
                env="household",
                follow=True,
                group_size=2,
                max_turns=3,
                seed=int(delay * 10),
            ),
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

    from gagpo.actors.prefetch import Prefetcher

    store = Store(str(store_dir))
    store.policies.set_latest(5)
    held = SimpleNamespace(version=0)
    warnings: list[str] = []
    prefetch = Prefetcher(store, str(store_dir / "cache"), warnings.append)
    assert prefetch.ready(held.version) is None
    assert warnings == []  # a pruned version is no failure: LATEST is read again ...
    assert prefetch.ready(held.version) is None and warnings == []  # ... at every poll

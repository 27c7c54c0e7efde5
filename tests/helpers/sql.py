"""A store whose every value is known, for the views of `gagpo sql` and the report."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pyarrow as pa

from gagpo.schemas import columns as C
from gagpo.schemas.layout import COMPLETE
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps

T0 = datetime(2026, 1, 1, tzinfo=UTC)


# --- a store with known values -------------------------------------------------------
def rollout(
    group: str,
    traj: str,
    states: list[str],
    rewards: list[float],
    *,
    shard: str,
    env: str,
    version: int,
    end: str = "done",
    invalid: tuple[int, ...] = (),
    minute: int = 0,
) -> list[dict]:
    """Rows of one rollout; `end` is how its last step ended ("done" or "truncated")."""
    rows = []
    for t, (state, reward) in enumerate(zip(states, rewards, strict=True)):
        last = t == len(states) - 1
        rows.append(
            {
                C.RUN_ID: "r1",
                C.SHARD_ID: shard,
                C.GROUP_ID: group,
                C.TRAJ_ID: traj,
                C.STEP: t,
                C.ENV: env,
                C.TASK_ID: f"{env}-task",
                C.STATE_KEY: state,
                C.NEXT_STATE_KEY: None if last and end == "done" else f"{state}'",
                C.OBSERVATION: f"you see {state}",
                C.PROMPT_IDS: [1, 2],
                C.ACTION_TEXT: f"act{t}",
                C.ACTION_IDS: [3],
                C.BEHAVIOR_LOGPROBS: [-0.1],
                C.POLICY_VERSION: version,
                C.REWARD: reward,
                C.DONE: last and end == "done",
                C.TRUNCATED: last and end == "truncated",
                C.ACTION_VALID: t not in invalid,
                C.WON: last and end == "done",
                C.CREATED_AT: T0.replace(minute=minute),
            }
        )
    return rows


def write_advantages(store: Store, tag: str, shard: str, rows: list[dict], params: dict) -> None:
    table = pa.Table.from_pylist(rows, schema=C.ADVANTAGES_SCHEMA)
    metadata = {
        C.META_ESTIMATOR: tag.split("-")[0].encode(),
        C.META_ESTIMATOR_PARAMS: json.dumps(params).encode(),
    }
    store.write_parquet(table, store.advantages_path(tag, shard), metadata)


def adv_rows(values: dict[tuple[str, int], tuple]) -> list[dict]:
    """(traj, step) -> (state, return, value_proxy, next_value_proxy, td, advantage, pool)."""
    rows = []
    for (traj, step), (state, ret, v, v_next, td, adv, pool) in values.items():
        rows.append(
            {
                C.TRAJ_ID: traj,
                C.STEP: step,
                C.GROUP_ID: "gB",
                C.STATE_KEY: state,
                C.RETURN: ret,
                C.VALUE_PROXY: v,
                C.NEXT_VALUE_PROXY: v_next,
                C.TD_RESIDUAL: td,
                C.ADVANTAGE_RAW: adv * 2,
                C.ADVANTAGE: adv,
                C.STATE_GROUP_SIZE: pool,
            }
        )
    return rows


def build_known_store(store: Store) -> Store:
    """Two shards of one group each (G = 2), advantages for group gB only, policy v1..v2.

    gA (grid, version 0): a0 s0 s1 s2, rewards 0 0 1, done; a1 s0 s1 s3 s4, rewards 0,
        truncated, step 2 invalid.  Pools: s0 ×2, s1 ×2, s2 s3 s4 singletons.
    gB (house, version 1): b0 h0 h1, rewards 0 1, done; b1 h0 h0 h1, rewards 0 0 1, done.
    """
    group_a = rollout("gA", "a0", ["s0", "s1", "s2"], [0, 0, 1], shard="shA", env="grid", version=0)
    group_a += rollout(
        "gA",
        "a1",
        ["s0", "s1", "s3", "s4"],
        [0, 0, 0, 0],
        shard="shA",
        env="grid",
        version=0,
        end="truncated",
        invalid=(2,),
    )
    group_b = rollout(
        "gB", "b0", ["h0", "h1"], [0, 1], shard="shB", env="house", version=1, minute=5
    )
    group_b += rollout(
        "gB", "b1", ["h0", "h0", "h1"], [0, 0, 1], shard="shB", env="house", version=1, minute=5
    )
    for rows in (group_a, group_b):
        store.write_shard(pa.Table.from_pylist(rows, schema=C.STEPS_SCHEMA), group_size=2)
    # "gagpo" with γ = 0.9: V(h0) = (0.9 + 0.81 + 0.9)/3 = 0.87, V(h1) = 1.
    write_advantages(
        store,
        "gagpo",
        "shB",
        adv_rows(
            {
                ("b0", 0): ("h0", 0.9, 0.87, 1.0, 0.03, 0.5, 3),
                ("b0", 1): ("h1", 1.0, 1.0, 0.0, 0.0, -0.1, 2),
                ("b1", 0): ("h0", 0.81, 0.87, 0.87, -0.087, -0.3, 3),
                ("b1", 1): ("h0", 0.9, 0.87, 1.0, 0.03, 0.2, 3),
                ("b1", 2): ("h1", 1.0, 1.0, 0.0, 0.0, -0.3, 2),
            }
        ),
        {"gamma": 0.9, "lam": 0.8},
    )
    # "gigpo" with γ = 0.95: V(h0) = (0.95 + 0.9025 + 0.95)/3.
    v_h0 = (0.95 + 0.9025 + 0.95) / 3
    write_advantages(
        store,
        "gigpo",
        "shB",
        adv_rows(
            {
                ("b0", 0): ("h0", 0.95, v_h0, 1.0, 0.0, -0.2, 3),
                ("b0", 1): ("h1", 1.0, 1.0, 0.0, 0.0, 0.3, 2),
                ("b1", 0): ("h0", 0.9025, v_h0, v_h0, 0.0, 0.4, 3),
                ("b1", 1): ("h0", 0.95, v_h0, 1.0, 0.0, 0.1, 3),
                ("b1", 2): ("h1", 1.0, 1.0, 0.0, 0.0, 0.1, 2),
            }
        ),
        {"gamma": 0.95, "omega": 1.0},
    )
    # Temporaries are never read: a torn shard and a torn advantage file.
    store.fs.pipe_file(store.path("shards", "run=r1", ".tmp-dead-shC.parquet"), b"PAR1 torn")
    store.fs.pipe_file(store.path("advantages", "gagpo", ".tmp-dead-shC.parquet"), b"PAR1 torn")
    # v1 is published (LATEST = 1) and complete; v2 is still being written; v0, which
    # generated steps, was published and has been pruned since.
    for version in (1, 2):
        store.commit_bytes(store.path("policy", f"v{version}", "config.json"), b"{}")
    store.commit_bytes(store.path("policy", "v1", COMPLETE), b"{}")
    store.policies.set_latest(1)
    return store


def write_histograms(store: Store) -> None:
    """learner/histograms.zarr as the learner lays it out: int64 [updates, bins]."""
    import numpy as np
    import zarr

    group = zarr.open_group(store.path("learner", "histograms.zarr"), mode="a")
    staleness = group.create_array("staleness", shape=(2, 3), dtype="int64")
    staleness[...] = np.array([[4, 0, 0], [2, 1, 1]])
    staleness.attrs["edges"] = [0, 1, 2]  # one label per bin
    weights = group.create_array("behavior_weight", shape=(2, 2), dtype="int64")
    weights[...] = np.array([[5, 1], [3, 3]])
    weights.attrs["edges"] = [0.0, 2.0, 4.0]  # bins + 1 edges


def compacted_store(root, shards: int = 8, archived: int = 5) -> Store:
    """`shards` shards of 1–2 groups (G = 3); the first `archived` compacted."""
    from gagpo.storage.compaction import compact

    store = Store(str(root))
    refs = []
    for i in range(shards):
        steps = make_steps(run_id=f"r{i % 2}", shard_id=f"s{i:03d}", groups=1 + i % 2, group_size=3)
        refs.append(store.write_shard(steps, group_size=3))
    compact(store, refs[:archived], None)
    return store

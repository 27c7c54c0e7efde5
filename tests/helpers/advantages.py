"""Steps tables written as rollouts of state keys, and the check of compute_advantages
against the brute-force reference (pipeline/reference.py) on every column of every step."""

from __future__ import annotations

import numpy as np
import polars as pl

from gagpo.pipeline import compute_advantages
from gagpo.pipeline.reference import reference_advantages
from gagpo.schemas import columns as C

TOL = 1e-9
FLOAT_COLUMNS = (
    C.RETURN,
    C.VALUE_PROXY,
    C.NEXT_VALUE_PROXY,
    C.TD_RESIDUAL,
    C.ADVANTAGE_RAW,
    C.ADVANTAGE,
)


def rollout(states, rewards, end="done", next_state=None):
    """One rollout spec: visited states, rewards, how it ends and (if truncated) where to."""
    return {"states": list(states), "rewards": list(rewards), "end": end, "next": next_state}


def steps_frame(groups: dict[str, list[dict]]) -> pl.DataFrame:
    """A steps table with only the input columns, from {group_id: [rollout specs]}."""
    rows = []
    for gid, rollouts in groups.items():
        for j, spec in enumerate(rollouts):
            n = len(spec["states"])
            for t, (state, reward) in enumerate(zip(spec["states"], spec["rewards"], strict=True)):
                last = t == n - 1
                if not last:
                    next_key = spec["states"][t + 1]
                else:
                    next_key = spec["next"] if spec["end"] == "truncated" else None
                rows.append(
                    {
                        C.GROUP_ID: gid,
                        C.TRAJ_ID: f"{gid}/r{j}",
                        C.STEP: t,
                        C.STATE_KEY: state,
                        C.NEXT_STATE_KEY: next_key,
                        C.REWARD: float(reward),
                        C.DONE: last and spec["end"] == "done",
                        C.TRUNCATED: last and spec["end"] == "truncated",
                    }
                )
    return pl.DataFrame(
        rows,
        schema={
            C.GROUP_ID: pl.String,
            C.TRAJ_ID: pl.String,
            C.STEP: pl.Int32,
            C.STATE_KEY: pl.String,
            C.NEXT_STATE_KEY: pl.String,
            C.REWARD: pl.Float32,
            C.DONE: pl.Boolean,
            C.TRUNCATED: pl.Boolean,
        },
    )


def run(frame: pl.DataFrame, config) -> pl.DataFrame:
    return compute_advantages(frame.lazy(), config).collect().sort(C.TRAJ_ID, C.STEP)


def assert_matches_reference(frame: pl.DataFrame, config) -> pl.DataFrame:
    """compute_advantages equals the reference to 1e-9 on every column of every step."""
    got = run(frame, config)
    expected = pl.DataFrame(reference_advantages(frame.to_dicts(), config)).sort(C.TRAJ_ID, C.STEP)
    assert got.columns == list(C.ADVANTAGES_COLUMNS)
    assert got.height == frame.height == expected.height
    for name in (C.TRAJ_ID, C.STEP, C.GROUP_ID, C.STATE_KEY, C.STATE_GROUP_SIZE):
        assert got[name].to_list() == expected[name].to_list(), name
    for name in FLOAT_COLUMNS:
        err = np.abs(got[name].to_numpy() - expected[name].to_numpy()).max()
        assert err <= TOL, f"{config.estimator} {name}: max abs error {err}"
    return got

"""Valid steps tables built without running actors, and a store's steps read back."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import pyarrow as pa

from gagpo.schemas import columns as C
from gagpo.storage.store import Store


def make_steps(
    *,
    run_id: str = "run1",
    shard_id: str = "shard1",
    groups: int = 2,
    group_size: int = 3,
    lengths: list[int] | None = None,
    policy_version: int = 0,
) -> pa.Table:
    """Whole groups of rollouts; rollout j of every group has lengths[j] steps (default 2+j)."""
    rows: dict[str, list] = {name: [] for name in C.STEPS_COLUMNS}
    now = datetime.now(UTC)
    for g in range(groups):
        for j in range(group_size):
            n = lengths[j] if lengths else 2 + j
            for t in range(n):
                last = t == n - 1
                values = {
                    C.RUN_ID: run_id,
                    C.SHARD_ID: shard_id,
                    C.GROUP_ID: f"{shard_id}-g{g}",
                    C.TRAJ_ID: f"{shard_id}-g{g}-r{j}",
                    C.STEP: t,
                    C.ENV: "test",
                    C.TASK_ID: f"test-{g}",
                    C.STATE_KEY: f"s{t}",
                    C.NEXT_STATE_KEY: None if last else f"s{t + 1}",
                    C.OBSERVATION: f"obs {t}",
                    C.PROMPT_IDS: [1, 2, 3],
                    C.ACTION_TEXT: "go",
                    C.ACTION_IDS: [4, 5],
                    C.BEHAVIOR_LOGPROBS: [-0.5, -1.0],
                    C.POLICY_VERSION: policy_version,
                    C.REWARD: 1.0 if last else 0.0,
                    C.DONE: last,
                    C.TRUNCATED: False,
                    C.ACTION_VALID: True,
                    C.WON: last,
                    C.CREATED_AT: now,
                }
                for name, value in values.items():
                    rows[name].append(value)
    return pa.Table.from_pydict(rows, schema=C.STEPS_SCHEMA)


def steps_of(store: Path) -> pl.DataFrame:
    """Every shard of the store at `store`, validated, in (task, rollout, step) order."""
    s = Store(str(store))
    tables = [s.read_shard(ref) for ref in s.list_shards()]  # validates each shard
    return pl.from_arrow(pa.concat_tables(tables)).sort(C.TASK_ID, C.TRAJ_ID, C.STEP)


# What the policy saw and did, and what it earned: the columns on which an environment
# played natively and the same one played through the agent endpoint must agree (the
# observation differs: the agent's is the message it sent).
PLAYED = (
    C.STEP,
    C.STATE_KEY,
    C.PROMPT_IDS,
    C.ACTION_IDS,
    C.BEHAVIOR_LOGPROBS,
    C.REWARD,
    C.DONE,
    C.TRUNCATED,
    C.WON,
)


def played(steps: pl.DataFrame) -> pl.DataFrame:
    """`steps` reduced to what was played, keyed by task seed and rollout index (the ids'
    last parts; the environment's name in them differs), in (task, rollout, step) order."""
    return (
        steps.with_columns(
            pl.col(C.TASK_ID).str.split("-").list.last(),
            pl.col(C.TRAJ_ID).str.split("-").list.last(),
        )
        .select(C.TASK_ID, C.TRAJ_ID, *PLAYED)
        .sort(C.TASK_ID, C.TRAJ_ID, C.STEP)
    )

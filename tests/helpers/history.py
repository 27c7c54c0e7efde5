"""Full-history multi-turn steps for the learner: step t's prompt is step t−1's prompt and
action followed by a new observation, as an agent that keeps its conversation sends it;
random token ids within the tiny policy's vocabulary, G rollouts per group."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from gagpo.schemas import columns as C
from tests.helpers.steps import make_steps

LIST_TYPES = {
    C.PROMPT_IDS: pa.list_(pa.int32()),
    C.ACTION_IDS: pa.list_(pa.int32()),
    C.BEHAVIOR_LOGPROBS: pa.list_(pa.float32()),
}


def conversations(
    rng: np.random.Generator,
    lengths: list[int],
    vocab: int,
    *,
    system: int = 4,
    observation: tuple[int, int] = (1, 3),
    action: tuple[int, int] = (1, 4),
    break_p: float = 0.0,
) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and actions of rollouts of `lengths` turns, step after step. With `break_p`,
    a step's history is edited (its first token dropped) with that probability: the step
    does not extend the one before."""
    prompts, actions = [], []
    for turns in lengths:
        history = rng.integers(3, vocab, system).tolist()
        for _ in range(turns):
            if prompts and break_p and rng.random() < break_p and len(history) > 1:
                history = history[1:]
            act = rng.integers(3, vocab, rng.integers(*action, endpoint=True)).tolist()
            prompts.append(list(history))
            actions.append(act)
            obs = rng.integers(3, vocab, rng.integers(*observation, endpoint=True)).tolist()
            history = history + act + obs
    return prompts, actions


def full_history_steps(
    *,
    groups: int = 2,
    group_size: int = 3,
    turns: int = 20,
    vocab: int = 48,
    seed: int = 0,
    shard_id: str = "h",
    break_p: float = 0.0,
    **shape,
) -> pa.Table:
    """STEPS_COLUMNS of `groups` groups of `group_size` rollouts, each `turns` turns long,
    prompts holding the whole history; random rewards and behaviour log-probs."""
    table = make_steps(
        shard_id=shard_id, groups=groups, group_size=group_size, lengths=[turns] * group_size
    )
    rng = np.random.default_rng(seed)
    lengths = [turns] * (groups * group_size)
    prompts, actions = conversations(rng, lengths, vocab, break_p=break_p, **shape)
    columns = {
        C.PROMPT_IDS: prompts,
        C.ACTION_IDS: actions,
        C.BEHAVIOR_LOGPROBS: [(-rng.uniform(2.5, 5.0, len(a))).tolist() for a in actions],
    }
    for name, values in columns.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(values, LIST_TYPES[name]))
    i = table.schema.get_field_index(C.REWARD)
    rewards = pa.array(rng.uniform(0, 1, table.num_rows).astype(np.float32))
    return table.set_column(i, table.schema.field(i), rewards)


def full_history_batch(**options) -> pa.Table:
    """`full_history_steps` as the learner's batch (BATCH_COLUMNS), with random advantages."""
    from gagpo.learner.feed import BATCH_COLUMNS

    table = full_history_steps(**options)
    rng = np.random.default_rng(options.get("seed", 0) + 1)
    table = table.append_column(C.ADVANTAGE, pa.array(rng.normal(size=table.num_rows)))
    return table.select(list(BATCH_COLUMNS))


def counted_once(table: pa.Table) -> int:
    """Each trajectory's tokens counted once when no step breaks its history: the last
    step's prompt + action per trajectory."""
    import polars as pl

    frame = pl.from_arrow(table.select([C.TRAJ_ID, C.STEP, C.PROMPT_IDS, C.ACTION_IDS]))
    last = frame.sort(C.STEP).group_by(C.TRAJ_ID).last()
    return int((last[C.PROMPT_IDS].list.len() + last[C.ACTION_IDS].list.len()).sum())

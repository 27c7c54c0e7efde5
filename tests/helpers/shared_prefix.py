"""Steps whose rollouts share states, for the prefix trie (learner/trie.py, issue 48):
each group's rollouts start from one system prompt and observation, and at each turn a
rollout picks one of `choices` replies; reply and next observation are functions of the
(group, choices so far), so rollouts agree until their choices part. Random token ids."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from gagpo.schemas import columns as C
from tests.helpers.steps import make_steps

LISTS = {
    C.PROMPT_IDS: pa.list_(pa.int32()),
    C.ACTION_IDS: pa.list_(pa.int32()),
    C.BEHAVIOR_LOGPROBS: pa.list_(pa.float32()),
}


def _tokens(key, low: int, high: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(key)
    return rng.integers(3, vocab, rng.integers(low, high + 1)).tolist()


def shared_steps(
    *,
    groups=2,
    group_size=4,
    turns=6,
    window=None,
    choices=2,
    seed=0,
    shard_id="t",
    vocab=48,
    system=(4, 8),
    observation=(1, 3),
    action=(1, 3),
) -> pa.Table:
    """STEPS_COLUMNS of rollouts that share states: each group's rollouts start from one
    system prompt and observation; at each turn a rollout picks one of `choices` replies,
    and reply and next observation are functions of the (group, choices so far), so
    rollouts agree until their choices part. With `window`, a prompt holds the system
    prompt and the last `window` turns only (steps then do not extend each other)."""
    table = make_steps(
        shard_id=shard_id, groups=groups, group_size=group_size, lengths=[turns] * group_size
    )
    rng = np.random.default_rng(seed)
    prompts, actions = [], []
    for traj in range(groups * group_size):
        g = traj // group_size
        head = _tokens([seed, g, 0], *system, vocab)
        turns_so_far, path = [], []
        obs = _tokens([seed, g, 1], *observation, vocab)
        for _ in range(turns):
            kept = turns_so_far if window is None else turns_so_far[len(turns_so_far) - window :]
            prompts.append(head + [t for turn in kept for t in turn] + obs)
            path.append(int(rng.integers(choices)))
            act = _tokens([seed, g, 2, *path], *action, vocab)
            actions.append(act)
            turns_so_far.append(obs + act)
            obs = _tokens([seed, g, 3, *path], *observation, vocab)
    columns = {
        C.PROMPT_IDS: prompts,
        C.ACTION_IDS: actions,
        C.BEHAVIOR_LOGPROBS: [(-rng.uniform(2.5, 5.0, len(a))).tolist() for a in actions],
    }
    for name, values in columns.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(values, LISTS[name]))
    i = table.schema.get_field_index(C.REWARD)
    rewards = pa.array(rng.uniform(0, 1, table.num_rows).astype(np.float32))
    return table.set_column(i, table.schema.field(i), rewards)


def shared_batch(**options) -> pa.Table:
    from gagpo.learner.feed import BATCH_COLUMNS

    table = shared_steps(**options)
    rng = np.random.default_rng(options.get("seed", 0) + 1)
    table = table.append_column(C.ADVANTAGE, pa.array(rng.normal(size=table.num_rows)))
    return table.select(list(BATCH_COLUMNS))

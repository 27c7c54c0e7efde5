"""Micro-batching: segment rows, right-padded, score each action exactly as its own unpadded row does."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gagpo.learner.batching import bucket, plan
from gagpo.learner.model import action_logprobs, load_model
from gagpo.schemas import columns as C
from tests.helpers.learner import tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def table(prompts, actions, behav=None, adv=None, versions=None) -> pa.Table:
    """Steps, each its own trajectory unless its prompt extends the previous row's."""
    n = len(prompts)
    return pa.table(
        {
            C.GROUP_ID: [f"g{i // 2}" for i in range(n)],
            C.TRAJ_ID: [f"t{i}" for i in range(n)],
            C.STEP: pa.array([0] * n, pa.int32()),
            C.PROMPT_IDS: pa.array(prompts, pa.list_(pa.int32())),
            C.ACTION_IDS: pa.array(actions, pa.list_(pa.int32())),
            C.BEHAVIOR_LOGPROBS: pa.array(
                behav or [[-1.0] * len(a) for a in actions], pa.list_(pa.float32())
            ),
            C.ADVANTAGE: pa.array(adv or [1.0] * n, pa.float64()),
            C.POLICY_VERSION: pa.array(versions or [0] * n, pa.int64()),
        }
    )


def batch(t: pa.Table, max_positions: int = 64, merge: bool = True, version: int = 0):
    (mb,) = plan(
        t,
        version=version,
        pad_id=0,
        max_positions=max_positions,
        budget=1 << 20,
        token_mean=False,
        merge=merge,
    )
    return mb


def test_collate_layout():
    mb = batch(table([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]]), version=2)
    assert mb.input_ids.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]  # right-padded
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert mb.position_ids[1].tolist()[:4] == [0, 1, 2, 3]
    assert mb.action_mask.tolist() == [[True, True, False], [True, True, True]]
    # each action token read where the token before it is: its own column − 1
    assert mb.token_rows.tolist() == [0, 0, 1, 1, 1]
    assert mb.token_cols.tolist() == [2, 3, 0, 1, 2]
    assert mb.staleness.tolist() == [2, 2] and mb.valid.all()


def test_a_trajectory_whose_prompts_extend_each_other_is_one_row():
    t = table([[5, 6], [5, 6, 7, 8, 9], [5, 6, 7, 9]], [[7], [10, 11], [12]])
    t = t.set_column(1, C.TRAJ_ID, pa.array(["t"] * 3)).set_column(
        2, C.STEP, pa.array([0, 1, 2], pa.int32())
    )
    mb = batch(t)  # step 2 breaks the history (9 where step 1 had 8): a new segment
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 9, 12, 0, 0]]
    assert mb.token_rows.tolist() == [0, 0, 0, 1] and mb.token_cols.tolist() == [1, 4, 5, 3]
    assert batch(t, merge=False).segments == 3


def test_invalid_actions_and_steps_past_the_context():
    t = table(
        [[1, 2, 3, 4, 5, 6], [], [7], [8]],
        [[9], [10], [], [11]],
        behav=[[-1.0], [-1.0], [], [float("nan")]],
    )
    mb = batch(t, max_positions=4)
    # the step past the context is in no row (never cut); no context, no tokens, not finite
    assert sorted(mb.input_ids.tolist()) == [[7, 0], [8, 11], [10, 0]]
    assert mb.valid.tolist() == [False, False, False]
    assert not mb.action_mask.any() and torch.isfinite(mb.logp_behav).all()


def test_bucket_respects_the_budget_and_keeps_every_row():
    lengths = np.array([5, 40, 7, 7, 100, 3, 20])
    groups = bucket(lengths, budget=40)
    assert sorted(np.concatenate(groups).tolist()) == list(range(7))
    for g in groups:
        assert len(g) == 1 or len(g) * lengths[g].max() <= 40


@pytest.mark.parametrize("token_mean", [False, True])
def test_plan_weights_sum_to_one(token_mean):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 40, rng.integers(1, 20)).tolist() for _ in range(9)]
    actions = [rng.integers(3, 40, rng.integers(1, 6)).tolist() for _ in range(9)]
    mbs = plan(
        table(prompts, actions),
        version=0,
        pad_id=0,
        max_positions=64,
        budget=48,
        token_mean=token_mean,
    )
    assert len(mbs) > 1 and sum(mb.weight for mb in mbs) == pytest.approx(1.0)


def test_padded_scores_equal_unpadded_scores():
    model = load_model(tiny_model_dir(), torch.device("cpu")).eval()
    prompts, actions = [[5, 6, 7, 8, 9], [10, 11], [12]], [[13, 14], [15, 16, 17], [18]]
    mb = batch(table(prompts, actions), max_positions=128)
    with torch.no_grad():
        logp, entropy = action_logprobs(model, mb, temperature=1.0, with_entropy=True)
        for i, (p, a) in enumerate(zip(prompts, actions, strict=True)):
            logits = model(torch.tensor([p + a])).logits[0, len(p) - 1 : -1].log_softmax(-1)
            ref = logits.gather(-1, torch.tensor(a)[:, None]).squeeze(-1)
            got = logp[i][mb.action_mask[i]]
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            ref_entropy = -(logits.exp() * logits).sum(-1)
            torch.testing.assert_close(
                entropy[i][mb.action_mask[i]], ref_entropy, atol=1e-5, rtol=1e-5
            )

"""Micro-batching: left-padded collation scores actions exactly as unpadded rows do."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gagpo.learner.batching import bucket, collate, plan
from gagpo.learner.model import action_logprobs, load_model
from gagpo.schemas import columns as C
from tests.helpers.learner import tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def table(prompts, actions, behav=None, adv=None, versions=None) -> pa.Table:
    n = len(prompts)
    return pa.table(
        {
            C.GROUP_ID: [f"g{i // 2}" for i in range(n)],
            C.PROMPT_IDS: pa.array(prompts, pa.list_(pa.int32())),
            C.ACTION_IDS: pa.array(actions, pa.list_(pa.int32())),
            C.BEHAVIOR_LOGPROBS: pa.array(
                behav or [[-1.0] * len(a) for a in actions], pa.list_(pa.float32())
            ),
            C.ADVANTAGE: pa.array(adv or [1.0] * n, pa.float64()),
            C.POLICY_VERSION: pa.array(versions or [0] * n, pa.int64()),
        }
    )


def test_collate_layout():
    mb = collate(
        table([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]]), version=2, pad_id=0, max_positions=64
    )
    assert mb.input_ids.tolist() == [[5, 6, 7, 9, 10], [0, 8, 11, 12, 13]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]
    assert mb.position_ids[1].tolist() == [0, 0, 1, 2, 3]
    assert mb.action_mask.tolist() == [[False, True, True], [True, True, True]]
    assert mb.staleness.tolist() == [2, 2] and mb.valid.all()


def test_invalid_actions_and_prompt_truncation():
    t = table(
        [[1, 2, 3, 4, 5, 6], [], [7], [8]],
        [[9], [10], [], [11]],
        behav=[[-1.0], [-1.0], [], [float("nan")]],
    )
    mb = collate(t, version=0, pad_id=0, max_positions=4)
    assert mb.input_ids[0].tolist()[-4:] == [4, 5, 6, 9]  # prompt cut from the left
    # no context, no tokens, non-finite behaviour log-prob
    assert mb.valid.tolist() == [True, False, False, False]
    assert not mb.action_mask[1:].any() and torch.isfinite(mb.logp_behav).all()


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
    mb = collate(table(prompts, actions), version=0, pad_id=0, max_positions=128)
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

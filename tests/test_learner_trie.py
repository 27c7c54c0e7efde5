"""A group's steps as one prefix trie (learner/trie.py, issue 48): each distinct prefix
is encoded once, every action is read on exactly its own context (checked against the
definition), and the update equals today's per-segment update: the same loss, per-action
ratios, behaviour weights and gradients (fp32, ≤ 1e-5) on one process, with LoRA, when
the budget splits a group's trie, under FSDP on 2 CPU ranks; bf16 within its rounding."""

from __future__ import annotations

import copy

import numpy as np
import pyarrow as pa
import pytest
import torch

from gagpo.learner import trie as trie_module
from gagpo.learner.batching import plan
from gagpo.learner.model import action_logprobs, add_lora, load_model
from gagpo.learner.precision import autocast_dtype
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from tests.helpers.learner import tiny_model_dir
from tests.helpers.shared_prefix import shared_batch, shared_steps
from tests.helpers.updates import assert_fsdp_runs_agree, one_update

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOL = 1e-5
TRIE = "prefix_trie"  # the learner setting one_update compares
KW = dict(version=0, pad_id=0, max_positions=128, token_mean=False)


def distinct_prefixes(table: pa.Table) -> int:
    seen = set()
    for r in table.to_pylist():
        seq = r[C.PROMPT_IDS] + r[C.ACTION_IDS]
        seen.update((r[C.GROUP_ID], tuple(seq[: k + 1])) for k in range(len(seq)))
    return len(seen)


@pytest.mark.parametrize(("window", "budget"), [(None, 8192), (2, 8192), (None, 60)])
def test_each_action_is_read_on_exactly_its_context(window, budget):
    """From the micro-batch alone (ids, mask, positions, read columns, targets), each
    action token's context is its step's prompt + action before it: the tokens the read
    column attends to, by position, are exactly those; its target is the token."""
    table = shared_batch(groups=2, group_size=4, turns=6, window=window)
    mbs, stats = trie_module.plan(table, budget=budget, **KW)
    assert stats.distinct == distinct_prefixes(table)
    assert (stats.splits > 0) == (budget < 8192)
    assert stats.tokens == sum(mb.tokens for mb in mbs)
    if budget == 8192:
        assert stats.tokens == stats.distinct < stats.segment_tokens
    expected = {}
    for r in table.to_pylist():
        for k, tok in enumerate(r[C.ACTION_IDS]):
            seq = r[C.PROMPT_IDS] + r[C.ACTION_IDS]
            expected.setdefault(float(np.float32(r[C.ADVANTAGE])), []).append(
                (tuple(seq[: len(r[C.PROMPT_IDS]) + k]), tok)
            )
    got = {}
    for mb in mbs:
        assert mb.segments == 1 or mb.input_ids.numel() <= budget
        reads = iter(
            zip(mb.token_rows.tolist(), mb.token_cols.tolist(), mb.targets().tolist(), strict=True)
        )
        for a in range(mb.action_mask.shape[0]):
            for _ in range(int(mb.action_mask[a].sum())):
                row, col, target = next(reads)
                cols = torch.nonzero(mb.tree_mask[row, col]).flatten()
                assert cols[-1] == col
                pos = mb.position_ids[row, cols]
                assert torch.equal(pos, torch.arange(len(cols)))  # one token per depth
                context = tuple(mb.input_ids[row, cols].tolist())
                got.setdefault(float(mb.advantages[a]), []).append((context, target))
    assert got == expected


def assert_same(a: dict, b: dict, terms: bool = True) -> None:
    keys = ("loss", "pg_loss", "kl_ref", "entropy") if terms else ("pg_loss",)
    for key in (*keys, "approx_kl", "behavior_weight_mean"):
        assert abs(a["stats"][key] - b["stats"][key]) <= TOL, key
    assert a["stats"]["action_tokens"] == b["stats"]["action_tokens"]
    assert np.abs(a["ratio"] - b["ratio"]).max() <= TOL
    assert np.abs(a["weight"] - b["weight"]).max() <= TOL
    assert np.abs(a["ratio"] - 1).max() > 5e-5  # the second slice's ratios moved
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        assert ga.keys() == gb.keys()
        for name in ga:
            assert (ga[name] - gb[name]).abs().max() <= TOL, name
        assert any(g.abs().max() > 1e-4 for g in ga.values())


@pytest.mark.parametrize(("window", "budget"), [(None, 8192), (2, 8192), (None, 60)])
def test_trie_update_equals_segment_update(monkeypatch, window, budget):
    """With the KL and entropy terms where both sides form one micro-batch per slice (they
    are token means per micro-batch); with a budget that splits tries, the policy-gradient
    loss, ratios, weights and gradients."""
    table = shared_batch(groups=2, group_size=4, turns=6, window=window, seed=1)
    base = load_model(tiny_model_dir(), torch.device("cpu"))
    ref = load_model(tiny_model_dir(), torch.device("cpu")).eval().requires_grad_(False)
    terms = budget == 8192
    tree = one_update(copy.deepcopy(base), ref, table, True, monkeypatch, budget, terms, TRIE)
    segs = one_update(copy.deepcopy(base), ref, table, False, monkeypatch, budget, terms, TRIE)
    assert tree["stats"]["tree_token_ratio"] > (1.3 if terms else 1.0)
    assert segs["stats"]["tree_token_ratio"] is None
    assert (tree["stats"]["tree_splits"] > 0) == (budget < 8192)
    assert tree["stats"]["tokens"] < segs["stats"]["tokens"]
    assert_same(tree, segs, terms)


def test_trie_update_equals_segment_update_with_lora(monkeypatch):
    table = shared_batch(groups=2, group_size=4, turns=6, window=2, seed=2)
    base = load_model(tiny_model_dir(), torch.device("cpu"))
    torch.manual_seed(0)
    add_lora(base, 4, 8.0, ["q_proj", "v_proj"])
    ref = load_model(tiny_model_dir(), torch.device("cpu")).eval().requires_grad_(False)
    tree = one_update(copy.deepcopy(base), ref, table, True, monkeypatch, 8192, True, TRIE)
    segs = one_update(copy.deepcopy(base), ref, table, False, monkeypatch, 8192, True, TRIE)
    assert all("lora_" in name for name in tree["grads"][0])
    assert_same(tree, segs)


def test_trie_scores_equal_segment_scores_under_bf16_autocast():
    table = shared_batch(groups=1, group_size=4, turns=6, seed=3)
    model = load_model(tiny_model_dir(), torch.device("cpu")).eval()
    scores = {}
    for tree in (True, False):
        for precision in ("bf16", "fp32"):
            if tree:
                (mb,), _ = trie_module.plan(table, budget=8192, **KW)
            else:
                (mb,) = plan(table, budget=8192, **KW)
            with torch.no_grad():
                logp, _ = action_logprobs(model, mb, 1.0, False, autocast_dtype(precision))
            order = torch.argsort(mb.advantages)
            scores[tree, precision] = logp[order][mb.action_mask[order]]
    assert not torch.equal(scores[True, "bf16"], scores[True, "fp32"])  # autocast ran
    assert (scores[True, "bf16"] - scores[False, "bf16"]).abs().max() < 0.05
    assert (scores[True, "fp32"] - scores[False, "fp32"]).abs().max() < TOL


def test_a_hash_collision_fails_loudly(monkeypatch):
    """With moduli 2 and 3 different prefixes share hashes: the exact check refuses."""
    monkeypatch.setattr(trie_module, "_MODULI", (2, 3))
    table = shared_batch(groups=1, group_size=4, turns=4)
    with pytest.raises(GagpoError, match="share a hash"):
        trie_module.plan(table, budget=8192, **KW)


@pytest.mark.slow
def test_fsdp_trie_equals_segments(tmp_path):
    """Two CPU ranks under FSDP, with the trie and with segments, on the same store: the
    published parameters agree to 1e-5 (lr 1, adam_eps 1: AdamW's first step ≈ lr·g)."""
    assert_fsdp_runs_agree(
        tmp_path,
        ("--prefix-trie", "--no-prefix-trie"),
        lambda i: shared_steps(groups=2, group_size=3, turns=6, window=2, seed=i, shard_id=f"s{i}"),
    )

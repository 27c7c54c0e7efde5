"""Turn merging (learner/batching.py): each trajectory's steps whose prompts extend each
other are encoded once, as one segment, and the update is the per-step update: the same
loss, per-action ratios, behaviour weights and gradients (fp32, ≤ 1e-5) on one process,
with LoRA, and under FSDP on 2 CPU ranks. Steps past the context are left out, never cut."""

from __future__ import annotations

import copy

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from gagpo.learner import update as update_module
from gagpo.learner.batching import plan, segment
from gagpo.learner.model import add_lora, load_model
from gagpo.schemas import columns as C
from tests.helpers.history import counted_once, full_history_batch, full_history_steps
from tests.helpers.learner import tiny_model_dir
from tests.helpers.updates import TOL, assert_fsdp_runs_agree, assert_same_update, one_update

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def brute_force_segments(table: pa.Table, max_positions: int) -> list[list[tuple[str, int]]]:
    """Segments as lists of (traj_id, step), by the definition, one step at a time."""
    rows = sorted(table.to_pylist(), key=lambda r: (r[C.GROUP_ID], r[C.TRAJ_ID], r[C.STEP]))
    out, prev = [], None
    for r in rows:
        seq = r[C.PROMPT_IDS] + r[C.ACTION_IDS]
        if not seq or len(seq) > max_positions:
            prev = None
            continue
        if prev is not None and prev[0] == r[C.TRAJ_ID]:
            before = prev[1]
            if r[C.PROMPT_IDS][: len(before)] == before:
                out[-1].append((r[C.TRAJ_ID], r[C.STEP]))
                prev = (r[C.TRAJ_ID], seq)
                continue
        out.append([(r[C.TRAJ_ID], r[C.STEP])])
        prev = (r[C.TRAJ_ID], seq)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_breaks_start_segments_as_the_brute_force_does(seed):
    table = full_history_batch(groups=2, group_size=3, turns=12, seed=seed, break_p=0.25)
    max_positions = 40  # some later steps do not fit: in no segment
    segs = segment(table, max_positions)
    ordered = table.take(
        pc.sort_indices(table, [(c, "ascending") for c in (C.GROUP_ID, C.TRAJ_ID, C.STEP)])
    )
    keys = list(zip(ordered[C.TRAJ_ID].to_pylist(), ordered[C.STEP].to_pylist(), strict=True))
    got = [[keys[i] for i in np.flatnonzero(segs.segment == s)] for s in range(len(segs.last))]
    expected = brute_force_segments(table, max_positions)
    assert got == expected
    assert any(len(s) > 1 for s in got) and len(got) > 6  # merges and breaks both occur
    # merging off: every encoded step alone
    alone = segment(table, max_positions, merge=False)
    assert len(alone.last) == sum(len(s) for s in expected)


def test_merged_tokens_are_each_trajectory_once():
    table = full_history_batch(groups=2, group_size=3, turns=20)
    kw = dict(version=0, pad_id=0, max_positions=128, budget=512, token_mean=False)
    merged, per_step = plan(table, **kw), plan(table, merge=False, **kw)
    assert sum(mb.segments for mb in merged) == 6  # one row per trajectory
    assert sum(mb.tokens for mb in merged) == counted_once(table)
    assert sum(mb.tokens for mb in per_step) > 5 * counted_once(table)
    for mbs in (merged, per_step):  # every action once, packed within the budget
        assert sum(int(mb.valid.sum()) for mb in mbs) == table.num_rows
        assert all(mb.segments == 1 or mb.input_ids.numel() <= 512 for mb in mbs)


@pytest.mark.parametrize(("budget", "terms"), [(512, False), (8192, True)])
def test_merged_update_equals_per_step_update(monkeypatch, budget, terms):
    table = full_history_batch(groups=2, group_size=3, turns=20)
    base = load_model(tiny_model_dir(), torch.device("cpu"))
    ref = load_model(tiny_model_dir(), torch.device("cpu")).eval().requires_grad_(False)
    merged = one_update(copy.deepcopy(base), ref, table, True, monkeypatch, budget, terms)
    per_step = one_update(copy.deepcopy(base), ref, table, False, monkeypatch, budget, terms)
    assert merged["stats"]["segments"] == 6 and per_step["stats"]["segments"] == 120
    if terms:
        assert merged["stats"]["kl_ref"] > 0 and merged["stats"]["entropy"] > 0
    assert_same_update(merged, per_step)


def test_merged_update_equals_per_step_update_with_lora(monkeypatch):
    table = full_history_batch(groups=2, group_size=3, turns=20, seed=3)
    base = load_model(tiny_model_dir(), torch.device("cpu"))
    torch.manual_seed(0)
    add_lora(base, 4, 8.0, ["q_proj", "v_proj"])
    ref = load_model(tiny_model_dir(), torch.device("cpu")).eval().requires_grad_(False)
    merged = one_update(copy.deepcopy(base), ref, table, True, monkeypatch)
    per_step = one_update(copy.deepcopy(base), ref, table, False, monkeypatch)
    assert all("lora_" in name for name in merged["grads"][0])
    assert_same_update(merged, per_step)


def test_a_step_past_the_context_is_left_out_never_cut(monkeypatch, capsys):
    """The tiny policy's context is 128 tokens: the late steps of 40-turn rollouts exceed
    it. They are counted, left out of the loss, and named once; the update equals the one
    on the table without them."""
    table = full_history_batch(groups=2, group_size=3, turns=40, seed=5)
    n = pc.add(
        pc.list_value_length(table[C.PROMPT_IDS]),
        pc.list_value_length(table[C.ACTION_IDS]),
    )
    over = pc.greater(n, 128)
    count = pc.sum(over).as_py()
    assert 0 < count < table.num_rows
    update_module._SAID_CONTEXT.clear()
    base = load_model(tiny_model_dir(), torch.device("cpu"))
    ref = load_model(tiny_model_dir(), torch.device("cpu")).eval().requires_grad_(False)
    whole = one_update(copy.deepcopy(base), ref, table, True, monkeypatch)
    warned = capsys.readouterr().err
    assert f"{count} step(s)" in warned and "max_position_embeddings = 128" in warned
    one_update(copy.deepcopy(base), ref, table, True, monkeypatch)
    assert capsys.readouterr().err == ""  # named once
    fitting = one_update(copy.deepcopy(base), ref, table.filter(pc.invert(over)), True, monkeypatch)
    assert whole["stats"]["context_skipped"] == count
    assert fitting["stats"]["context_skipped"] == 0
    assert whole["stats"]["actions"] == table.num_rows
    assert whole["stats"]["masked_actions"] == count
    assert whole["stats"]["tokens"] == fitting["stats"]["tokens"]  # nothing of them encoded
    assert_same_update(whole, fitting, fewer_tokens=False)


@pytest.mark.slow
def test_fsdp_merged_equals_per_step(tmp_path):
    """Two CPU ranks under FSDP, with merging and without, on the same store: the published
    parameters agree to 1e-5. lr 1 with adam_eps 1 makes AdamW's first step about lr·g, so
    a gradient difference shows in the weights (a plain AdamW step would only keep signs)."""
    assert_fsdp_runs_agree(
        tmp_path,
        ("--merge-turns", "--no-merge-turns"),
        lambda i: full_history_steps(groups=2, group_size=3, turns=20, seed=i, shard_id=f"s{i}"),
    )


def test_merged_scores_equal_per_step_scores_under_bf16_autocast():
    """bf16 autocast (precision = "bf16"): the hook gathers bf16 hidden states, and each
    action's log-probs agree with its per-step row's up to bf16 rounding."""
    from gagpo.learner.model import action_logprobs
    from gagpo.learner.precision import autocast_dtype

    table = full_history_batch(groups=1, group_size=2, turns=20, seed=7)
    model = load_model(tiny_model_dir(), torch.device("cpu")).eval()
    kw = dict(version=0, pad_id=0, max_positions=128, budget=8192, token_mean=False)
    scores = {}
    for merge in (True, False):
        for precision in ("bf16", "fp32"):
            (mb,) = plan(table, merge=merge, **kw)
            with torch.no_grad():
                logp, _ = action_logprobs(model, mb, 1.0, False, autocast_dtype(precision))
            order = torch.argsort(mb.advantages)
            scores[merge, precision] = logp[order][mb.action_mask[order]]
    assert scores[True, "bf16"].dtype == torch.float32
    assert not torch.equal(scores[True, "bf16"], scores[True, "fp32"])  # autocast ran
    assert (scores[True, "bf16"] - scores[False, "bf16"]).abs().max() < 0.05
    assert (scores[True, "fp32"] - scores[False, "fp32"]).abs().max() < TOL

"""Action log-probs in vocabulary chunks (learner/vocab_chunks.py, issue 48): the chunked
log-softmax and entropy, recomputed in the backward, equal the full-vocabulary path's
numbers and gradients (fp32 ≤ 1e-5) alone, through a whole update, with LoRA, and under
bf16 autocast within bf16's own rounding."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from gagpo.learner import update as update_module
from gagpo.learner import vocab_chunks
from gagpo.learner.batching import plan
from gagpo.learner.model import action_logprobs, add_lora, load_model
from gagpo.learner.precision import autocast_dtype
from tests.helpers.history import full_history_batch
from tests.helpers.learner import tiny_model_dir
from tests.helpers.updates import assert_same_update, one_update

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOL = 1e-5


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 7 columns: the tiny vocabulary (48) is walked in 7 chunks, the last short."""
    monkeypatch.setattr(vocab_chunks, "MIN_CHUNK", 7)
    monkeypatch.setattr(vocab_chunks, "CHUNK_ELEMENTS", 1)


def full(head: nn.Linear, h, targets, tau):
    z = head(h).float() / tau
    log_z = torch.logsumexp(z, -1)
    return z.gather(1, targets[:, None]).squeeze(1) - log_z, log_z - (z.softmax(-1) * z).sum(-1)


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_full_vocabulary_with_gradients(small_chunks, bias):
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=bias)
    h = torch.randn(9, 16, requires_grad=True)
    targets = torch.randint(0, 50, (9,))
    weights = torch.randn(9), torch.randn(9)
    out = {}
    for name, fn in (("chunked", vocab_chunks.chunked_logprobs), ("full", full)):
        head.zero_grad()
        h.grad = None
        logp, ent = fn(head, h, targets, 0.7)
        ((logp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
        grads = [h.grad.clone(), head.weight.grad.clone()]
        grads += [head.bias.grad.clone()] if bias else []
        out[name] = [logp.detach(), ent.detach(), *grads]
    assert vocab_chunks.chunk_columns(9, 50) == 7
    for a, b in zip(out["chunked"], out["full"], strict=True):
        assert (a - b).abs().max() <= TOL
    assert out["full"][2].abs().max() > 1e-2  # gradients reach the hidden states


def full_path(monkeypatch):
    monkeypatch.setattr(
        update_module, "action_logprobs", functools.partial(action_logprobs, vocab_chunks=False)
    )


@pytest.mark.parametrize("lora", [False, True])
def test_update_equals_the_full_vocabulary_update(monkeypatch, small_chunks, lora):
    """A whole update (π_prox pass, reference pass, KL and entropy terms, two optimiser
    steps): the same loss, ratios, behaviour weights and gradients, within 1e-5."""
    table = full_history_batch(groups=2, group_size=3, turns=12, seed=4)
    base = load_model(tiny_model_dir(), torch.device("cpu"))
    if lora:
        torch.manual_seed(0)
        add_lora(base, 4, 8.0, ["q_proj", "v_proj"])
    ref = load_model(tiny_model_dir(), torch.device("cpu")).eval().requires_grad_(False)
    chunked = one_update(copy.deepcopy(base), ref, table, True, monkeypatch, 8192, True)
    full_path(monkeypatch)
    whole = one_update(copy.deepcopy(base), ref, table, True, monkeypatch, 8192, True)
    assert chunked["stats"]["entropy"] > 0 and chunked["stats"]["kl_ref"] > 0
    assert_same_update(chunked, whole, fewer_tokens=False)


def test_bf16_chunked_scores_equal_full_bf16_scores(small_chunks):
    table = full_history_batch(groups=1, group_size=2, turns=12, seed=7)
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    (mb,) = plan(table, version=0, pad_id=0, max_positions=128, budget=8192, token_mean=False)
    out = {}
    for chunked in (True, False):
        model.zero_grad()
        logp, ent = action_logprobs(model, mb, 1.0, True, autocast_dtype("bf16"), chunked)
        (logp.sum() + ent.sum()).backward()
        grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
        out[chunked] = logp.detach(), ent.detach(), grad
    fp32, _ = action_logprobs(model, mb, 1.0, False, None)
    assert not torch.equal(out[True][0], fp32.detach())  # autocast ran
    for a, b in zip(out[True], out[False], strict=True):
        assert (a - b).abs().max() <= 2e-2 * max(1.0, float(b.abs().max()))

"""One update of the learner (docs/design.md §4, "Learner objective").

An update takes a batch of B whole groups and makes `mini_batches` optimiser steps over
slices of it. π_prox is the policy at the start of the update, computed without grad:
for the first slice it equals π_θ before any step, so the first slice takes it from its
own forward pass (detached) and only later slices need a separate no-grad pass; with
dropout active, every slice gets the separate pass. Micro-batches accumulate gradients;
each carries its share of the loss denominator so the sum is the loss of the slice.

Under FSDP every forward and backward is a collective, so each rank pads its share of a
slice's micro-batches to the same count with passes whose loss is multiplied by zero.

`run_update` names its steps: the plan (slices, micro-batches, FSDP padding), the π_prox
pass, the micro-batch loop with one optimiser step per slice, and the metric reduction.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from gagpo.learner import faults, trie
from gagpo.learner.batching import MicroBatch, plan, step_lengths
from gagpo.learner.config import LearnerConfig
from gagpo.learner.dist import Dist, all_reduce, all_reduce_grads, clip_grads, is_sharded
from gagpo.learner.loss import gagpo_loss
from gagpo.learner.metrics import Histogram
from gagpo.learner.model import action_logprobs, has_dropout
from gagpo.learner.precision import autocast_dtype
from gagpo.learner.sft import sft_loss
from gagpo.learner.trie import TrieStats
from gagpo.schemas import columns as C

# Sums over micro-batches (then ranks): loss terms weighted by each micro-batch's share.
_WEIGHTED = ("loss", "pg_loss", "kl_ref", "entropy")
_PER_ACTION = ("approx_kl", "clip_frac", "behavior_weight_mean")
_COUNTS = ("ratio_bounded", "masked_actions", "actions", "action_tokens", "tokens", "segments")
_MISMATCH = ("mismatch_kl", "mismatch_tokens")  # summed over same-version tokens, then divided
_MAXIMA = ("behavior_weight_max", "mismatch_max_abs")
HISTOGRAMS = {
    "ratio": Histogram(0.0, 2.0),
    "behavior_weight": Histogram(0.0, 4.0),
    "advantage": Histogram(-4.0, 4.0),
}


def run_update(
    model,
    optimizer,
    scheduler,
    table: pa.Table,
    *,
    version: int,
    cfg: LearnerConfig,
    d: Dist,
    pad_id: int,
    ref_model=None,
) -> tuple[dict, dict]:
    """One update over `table` (BATCH_COLUMNS); returns metric sums and histogram counts."""
    max_pos = getattr(model.config, "max_position_embeddings", 1 << 20)
    sft = cfg.mode == "sft"  # supervised warm start (learner/sft.py): token-mean NLL, no π_prox
    sharded = is_sharded(model)
    amp = autocast_dtype(cfg.precision, sharded=sharded)  # bf16 compute, fp32 master weights
    skipped = _context_skipped(table, max_pos, d)
    slices = _plan(
        table,
        cfg,
        version=version,
        pad_id=pad_id,
        max_pos=max_pos,
        sharded=sharded,
        d=d,
        kappa=trie.pair_cost(model.config),
    )
    prox = {} if cfg.loss.bypass or sft else _proximal(model, slices, cfg, amp, sharded)
    params = [p for p in model.parameters() if p.requires_grad]
    acc = _Accumulators.zeros(d.device)
    for k, mbs in enumerate(slices.micro_batches):
        # logp_prox is the policy at `version`: π_prox, or when bypassed, π_θ before any step
        at_version = not sft and (k == 0 or not cfg.loss.bypass)
        for j, mb in enumerate(mbs):
            step = _MicroStep(mb, prox.get((k, j)), at_version, padding=j >= slices.real[k])
            _micro_batch(model, ref_model, step, cfg, amp, acc)
        faults.fault_point("backward")  # test hook: a kill here is a kill mid-update
        norm = _optimizer_step(params, optimizer, scheduler, cfg, d, reduce_grads=not sharded)
        acc.grad_norms.append(norm)
    out, hist = _reduce(acc, d, len(slices.micro_batches), skipped)
    out |= _tree_metrics(slices.tree)
    return out, hist


# --- the plan ----------------------------------------------------------------------------


@dataclass
class _Plan:
    """This rank's micro-batches per slice, on the device, padded under FSDP to the count
    of the rank with the most; `real[k]` of slice k's are not padding."""

    micro_batches: list[list[MicroBatch]]
    real: list[int]
    tree: TrieStats | None = None  # with prefix_trie: what the tries saved, summed over slices


def _plan(
    table, cfg: LearnerConfig, *, version, pad_id, max_pos, sharded, d: Dist, kappa=None
) -> _Plan:
    token_mean = cfg.loss.aggregation == "token_mean" or cfg.mode == "sft"
    out = _Plan([], [], TrieStats() if cfg.prefix_trie else None)
    for part in _slices(table, cfg.mini_batches):
        options = dict(
            version=version,
            pad_id=pad_id,
            max_positions=max_pos,
            budget=cfg.micro_batch_tokens,
            token_mean=token_mean,
            merge=cfg.merge_turns,
        )
        if out.tree is None:
            mbs = plan(part, **options)
        else:
            mbs, stats = trie.plan(part, **options, kappa=kappa)
            out.tree.add(stats)
        mine = mbs[d.rank :: d.world]
        padding = -(-len(mbs) // d.world) - len(mine) if sharded else 0
        out.micro_batches.append([mb.to(d.device) for mb in mine + mbs[:1] * padding])
        out.real.append(len(mine))
    return out


def _tree_metrics(tree: TrieStats | None) -> dict:
    """`tree_token_ratio`: tokens the segments would encode over tokens the prefix tries
    encode (the work saved, ≥ 1); `tree_splits`: trie rows past one per group, split at
    the micro-batch budget (between whole paths). None with prefix_trie off. Every rank
    plans the whole slice, so these are the update's own, not summed over ranks."""
    if tree is None:
        return {"tree_token_ratio": None, "tree_splits": None}
    return {
        "tree_token_ratio": tree.segment_tokens / max(tree.tokens, 1),
        "tree_splits": tree.splits,
    }


def _slices(table: pa.Table, n: int) -> list[pa.Table]:
    """`n` slices of whole groups, in batch order."""
    groups = table[C.GROUP_ID].unique()
    parts = np.array_split(np.arange(len(groups)), n)
    return [table.filter(pc.is_in(table[C.GROUP_ID], groups.take(p))) for p in parts]


_SAID_CONTEXT: set[int] = set()  # contexts whose overlong steps were named (once a process)


def _context_skipped(table: pa.Table, max_pos: int, d: Dist) -> int:
    """Steps longer than the model's context: counted, and named once in a warning line.
    They are left out of the loss, never cut: their actions were sampled on a context the
    learner cannot encode."""
    lengths = step_lengths(table)
    count = int((lengths > max_pos).sum())
    if count and d.main and max_pos not in _SAID_CONTEXT:
        _SAID_CONTEXT.add(max_pos)
        longest = int(lengths.max())
        print(
            f"warning: {count} step(s) of this batch (the longest {longest} tokens) exceed the "
            f"policy's context, max_position_embeddings = {max_pos} tokens of prompt + action: "
            "left out of the loss, never cut (metric context_skipped); keep the actors' "
            "sampling.max_prompt_tokens + max_new_tokens within it",
            file=sys.stderr,
        )
    return count


# --- the proximal pass -------------------------------------------------------------------


def _proximal(model, slices: _Plan, cfg: LearnerConfig, amp, sharded: bool) -> dict:
    """log π_prox, keyed (slice, micro-batch), of the micro-batches that cannot take it
    from their own forward pass: every slice's after the first, and with dropout active,
    the first's too."""
    separate_first = has_dropout(model)
    prox = {}
    model.eval()
    with torch.no_grad():
        for k, mbs in enumerate(slices.micro_batches):
            for j, mb in enumerate(mbs):
                if k > 0 or separate_first:
                    prox[k, j] = action_logprobs(model, mb, cfg.temperature, False, amp)[0]
    # FSDP2 keeps the root unsharded after a forward, for a backward that never comes after
    # a no-grad pass; left so, the root's parameters get no gradient in the training pass.
    if sharded:
        model.reshard()
    model.train()
    return prox


# --- the micro-batch loop ----------------------------------------------------------------


@dataclass
class _Accumulators:
    """Metric sums, maxima and histogram counts: on the device until `_reduce` reads them
    once, after the last step."""

    sums: dict[str, torch.Tensor]
    maxima: dict[str, torch.Tensor]
    hist: dict[str, torch.Tensor]
    grad_norms: list[float] = field(default_factory=list)

    @classmethod
    def zeros(cls, device: torch.device) -> _Accumulators:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        keys = _WEIGHTED + _PER_ACTION + _COUNTS + _MISMATCH + ("valid",)
        hist = {
            k: torch.zeros(h.bins, dtype=torch.long, device=device) for k, h in HISTOGRAMS.items()
        }
        return cls(dict.fromkeys(keys, zero), dict.fromkeys(_MAXIMA, zero), hist)


@dataclass
class _MicroStep:
    mb: MicroBatch
    logp_prox: torch.Tensor | None  # None: from this micro-batch's own forward pass
    at_version: bool  # logp_prox is the policy at the batch's version: mismatch is measured
    padding: bool  # FSDP padding: the collectives run, the gradient is zero


def _micro_batch(model, ref_model, step: _MicroStep, cfg: LearnerConfig, amp, acc) -> None:
    """Forward and backward of one micro-batch, its diagnostics added to `acc`."""
    mb = step.mb
    want_entropy = cfg.loss.entropy_coef > 0
    logp, entropy = action_logprobs(model, mb, cfg.temperature, want_entropy, amp)
    logp_prox = logp.detach() if step.logp_prox is None else step.logp_prox
    logp_ref = None
    if ref_model is not None:
        with torch.no_grad():
            logp_ref = action_logprobs(ref_model, mb, cfg.temperature, False, amp)[0]
    if cfg.mode == "sft":
        loss, m = sft_loss(logp, mb.action_mask)
    else:
        loss, m = gagpo_loss(
            logp,
            logp_prox,
            mb.logp_behav,
            mb.action_mask,
            mb.advantages,
            cfg.loss,
            logp_ref=logp_ref,
            entropy=entropy,
        )
    if step.padding:
        (loss * 0.0).backward()
        return
    (loss * mb.weight).backward()
    _accumulate(acc.sums, acc.hist, m, mb)
    _raise_max(acc.maxima, "behavior_weight_max", m["behavior_weight_max"].double())
    if step.at_version:
        _raise_max(acc.maxima, "mismatch_max_abs", _mismatch(acc.sums, mb, logp_prox))


def _raise_max(maxima: dict, key: str, value: torch.Tensor) -> None:
    maxima[key] = torch.maximum(maxima[key], value)


def _accumulate(sums, hist, m: dict, mb: MicroBatch) -> None:
    """Add one micro-batch's diagnostics (device tensors, `gagpo_loss` or `sft_loss`) to
    `sums` and its terms to the histograms: the ratios and behaviour weights the loss
    used, at its ratio level and bound (SFT has neither)."""
    valid = m["actions"] - m["masked_actions"]
    for key in _WEIGHTED:
        sums[key] = sums[key] + m[key] * mb.weight
    for key in _PER_ACTION:
        sums[key] = sums[key] + m[key] * valid
    sums["valid"] = sums["valid"] + valid
    for key, value in (
        ("ratio_bounded", m["ratio_bounded"]),
        ("masked_actions", m["masked_actions"]),
        ("actions", m["actions"]),
        ("action_tokens", m["tokens"]),
        ("tokens", mb.attention_mask.sum()),
        ("segments", mb.segments),
    ):
        sums[key] = sums[key] + value
    if "ratio" in m:
        hist["ratio"] += HISTOGRAMS["ratio"].counts(m["ratio"], m["ratio_mask"])
        hist["behavior_weight"] += HISTOGRAMS["behavior_weight"].counts(
            m["behavior_weight"], m["valid"]
        )
    hist["advantage"] += HISTOGRAMS["advantage"].counts(mb.advantages, mb.action_mask.any(1))


def _mismatch(sums, mb: MicroBatch, logp_learner: torch.Tensor) -> torch.Tensor:
    """Behaviour/learner mismatch on the actions generated by the learner's own version
    (staleness 0), where the two should agree up to numerics (bf16, kernels, engine):
    adds the k3 estimate of KL(π_behav ‖ π_learner) per token, (r − 1) − log r with
    r = π_learner/π_behav (Schulman 2020: unbiased and ≥ 0 for tokens sampled from
    π_behav), to `sums`, and returns max |log π_learner − log π_behav| (0 when none).
    Masked, not indexed: no device sync."""
    mask = mb.action_mask & (mb.staleness == 0)[:, None]  # [b, L]
    diff = (logp_learner.detach() - mb.logp_behav).double()
    log_r = torch.where(mask, diff, torch.zeros_like(diff)).clamp(-20, 20)  # [b, L], 0 off mask
    sums["mismatch_kl"] = sums["mismatch_kl"] + (torch.expm1(log_r) - log_r).sum()
    sums["mismatch_tokens"] = sums["mismatch_tokens"] + mask.sum()
    return log_r.abs().max()


def _optimizer_step(params, optimizer, scheduler, cfg, d: Dist, *, reduce_grads: bool) -> float:
    """One optimiser step on the slice's accumulated gradients; returns the gradient norm
    (before clipping). Under FSDP the backward pass summed them (reduce-scatter) already."""
    if reduce_grads:
        all_reduce_grads(params, d)
    norm = clip_grads(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    if torch.isfinite(norm):  # a non-finite gradient never reaches AdamW: the step is skipped
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


# --- the metric reduction ----------------------------------------------------------------


def _reduce(acc: _Accumulators, d: Dist, n_slices: int, skipped: int) -> tuple[dict, dict]:
    """The update's metrics, summed over ranks: one transfer from the device for all sums,
    one for the maxima, one for the histograms."""
    keys = sorted(acc.sums)
    total = all_reduce(torch.stack([acc.sums[k] for k in keys]).cpu(), d)
    sums = dict(zip(keys, total.tolist(), strict=True))
    maxima = torch.stack(list(acc.maxima.values())).cpu()
    top = dict(zip(acc.maxima, all_reduce(maxima, d, op="max").tolist(), strict=True))
    counts = all_reduce(torch.cat(list(acc.hist.values())).cpu(), d)
    hist = dict(zip(acc.hist, counts.split([h.bins for h in HISTOGRAMS.values()]), strict=True))
    out = {k: sums[k] / n_slices for k in _WEIGHTED}
    out |= {k: sums[k] / max(sums["valid"], 1.0) for k in _PER_ACTION}
    out |= {k: int(sums[k]) for k in _COUNTS}
    # Steps past the context are in no micro-batch: actions left out of the loss.
    out["context_skipped"] = skipped
    out["actions"] += skipped
    out["masked_actions"] += skipped
    out["behavior_weight_max"] = top["behavior_weight_max"]
    compared = sums["mismatch_tokens"]  # none: the batch holds no action of this version
    out["mismatch_kl"] = sums["mismatch_kl"] / compared if compared else None
    out["mismatch_max_abs"] = top["mismatch_max_abs"] if compared else None
    out["grad_norm"] = float(np.mean(acc.grad_norms))
    out["skipped_steps"] = sum(not np.isfinite(g) for g in acc.grad_norms)
    return out, {k: v.numpy() for k, v in hist.items()}

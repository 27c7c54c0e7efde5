"""The GAGPO learner objective (docs/design.md §4, "Learner objective"), a pure function of tensors.

For an action (one agent turn) with tokens y_1..y_L and advantage Ã:
    ℓ_k   = log π_θ(y_k) − log π_prox(y_k)
    ρ     = exp(mean_k ℓ_k)                                  action-level, length-normalised
    w     = min(exp(mean_k [log π_prox(y_k) − log π_behav(y_k)]), C)   detached behaviour weight
    loss  = − w · min(ρ·Ã, clip(ρ, 1−ε_low, 1+ε_high)·Ã)
averaged over actions (or over tokens), plus optional KL to a reference and an entropy
bonus. "bypass" sets π_prox = π_behav (w = 1). Token-level and sequence-sum ratios are
ablations. Every log-ratio is bounded before exp, so no inf/NaN reaches the optimiser;
actions whose inputs are not finite, or that have no tokens, are masked and counted.

The diagnostics stay tensors on the inputs' device: reading them here would stall the
GPU once per number and micro-batch. The learner sums them and reads them once per
update (learner/train.py); a test reads them with float().
"""

from __future__ import annotations

import math

import torch

from gagpo.learner.config import LossSettings


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, dim) -> torch.Tensor:
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def _log_ratio(log_ratio_tok: torch.Tensor, maskf: torch.Tensor, level: str) -> torch.Tensor:
    """log ρ at `level`, before bounding: ℓ_k per token [A, L]; per action their mean
    (length-normalised) or, per sequence, their sum [A]."""
    if level == "token":
        return log_ratio_tok
    summed = (log_ratio_tok * maskf).sum(1)
    return summed if level == "sequence" else summed / maskf.sum(1).clamp(min=1)


def _at(x: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """A per-action term [A] in ρ's shape ([A], or [A, 1] against a token-level [A, L])."""
    return x if ratio.dim() == 1 else x[:, None]


def _per_action(x: torch.Tensor, maskf: torch.Tensor) -> torch.Tensor:
    """A term in ρ's shape as one number per action [A]: its mean over the action's tokens."""
    return x if x.dim() == 1 else _masked_mean(x, maskf, 1)


def gagpo_loss(
    logp: torch.Tensor,  # [A, L] log π_θ of each action token (requires grad)
    logp_prox: torch.Tensor,  # [A, L] log π_prox (ignored in bypass mode)
    logp_behav: torch.Tensor,  # [A, L] log π_behav, recorded by the actor
    token_mask: torch.Tensor,  # [A, L] bool, True on real action tokens
    advantages: torch.Tensor,  # [A] normalised advantage Ã of each action
    config: LossSettings,
    logp_ref: torch.Tensor | None = None,  # [A, L] reference policy, for the KL term
    entropy: torch.Tensor | None = None,  # [A, L] per-token entropy of π_θ, for the bonus
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss and its diagnostics, computed beside it: 0-dim tensors (`actions`:
    an int), and the terms as the objective used them, for histograms:

        ratio, ratio_mask        ρ as bounded and used: [A] per action (action, sequence
                                 level) or [A, L] per token (token level); mask: the valid ones
        behavior_weight, valid   w of each action [A] (1 under bypass); the valid actions [A]
    """
    bound = config.log_ratio_bound
    logp_prox = (logp_behav if config.bypass else logp_prox).detach()

    # An action is masked when it has no tokens or any of its inputs is not finite.
    finite = torch.isfinite(logp_prox) & torch.isfinite(logp_behav) & torch.isfinite(logp.detach())
    mask = token_mask.bool()
    valid = mask.any(1) & (finite | ~mask).all(1) & torch.isfinite(advantages)  # [A]
    mask = mask & valid[:, None]  # [A, L]
    maskf = mask.to(logp.dtype)  # [A, L]
    adv = torch.where(valid, advantages, torch.zeros_like(advantages)).to(logp.dtype)  # [A]
    # Zero the non-finite entries first: 0·inf would be NaN even where masked out.
    safe = lambda x: torch.where(mask, x, torch.zeros_like(x))  # noqa: E731

    # Behaviour weight w = min(π_prox/π_behav, C): detached, one per action.
    log_w = _masked_mean(safe(logp_prox) - safe(logp_behav), maskf, 1)  # [A]
    w = torch.exp(log_w.clamp(-bound, min(bound, math.log(config.behavior_cap)))).detach()  # [A]

    # Ratio ρ = π_θ/π_prox at the chosen level: [A, L] per token, else [A]; log bounded.
    raw_log_ratio = _log_ratio(safe(logp) - safe(logp_prox), maskf, config.ratio_level)
    log_ratio = raw_log_ratio.clamp(-bound, bound)
    ratio = torch.exp(log_ratio)
    ratio_mask = mask if config.ratio_level == "token" else valid  # where ρ is used

    # One clipped surrogate (ρ's shape), one number per action, then the aggregation.
    clipped = ratio.clamp(1 - config.eps_low, 1 + config.eps_high)
    surrogate = torch.minimum(ratio * _at(adv, ratio), clipped * _at(adv, ratio))
    pg_action = _per_action(-_at(w, ratio) * surrogate, maskf)  # [A]
    weights = maskf.sum(1) if config.aggregation == "token_mean" else valid.to(logp.dtype)  # [A]
    pg_loss = (pg_action * weights).sum() / weights.sum().clamp(min=1)

    # Optional terms, per token; KL(π_θ ‖ π_ref) by k3: exp(r) − r − 1, r = log(π_ref/π_θ).
    kl = ent = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if config.kl_coef and logp_ref is not None:
        r = (safe(logp_ref.detach()) - safe(logp)).clamp(-bound, bound)  # [A, L]
        kl = _masked_mean(torch.exp(r) - r - 1, maskf, (0, 1))
    if config.entropy_coef and entropy is not None:
        ent = _masked_mean(safe(entropy), maskf, (0, 1))
    loss = pg_loss + config.kl_coef * kl - config.entropy_coef * ent

    with torch.no_grad():
        n_valid = valid.sum().clamp(min=1)
        action_log_ratio = torch.where(valid, _per_action(log_ratio, maskf), 0.0)  # [A]
        bounded = (raw_log_ratio.abs() > bound) & ratio_mask  # ρ's shape
        metrics = {
            "loss": loss.detach(),
            "pg_loss": pg_loss.detach(),
            "kl_ref": kl.detach(),
            "entropy": ent.detach(),
            # k3 estimate of KL(π_prox ‖ π_θ) over actions (0 for a masked one)
            "approx_kl": (torch.exp(-action_log_ratio) - 1 + action_log_ratio).sum() / n_valid,
            "clip_frac": ((ratio != clipped) & ratio_mask).sum() / ratio_mask.sum().clamp(min=1),
            "behavior_weight_mean": (w * valid).sum() / n_valid,
            "behavior_weight_max": torch.where(valid, w, torch.zeros_like(w)).max(),
            "ratio_bounded": (bounded if bounded.dim() == 1 else bounded.any(1)).sum(),
            "masked_actions": (~valid).sum(),
            "actions": valid.numel(),  # a shape: known without the device
            "tokens": maskf.sum(),
            "ratio": ratio.detach(),
            "ratio_mask": ratio_mask,
            "behavior_weight": w,
            "valid": valid,
        }
    return loss, metrics

"""Action log-probs and entropies without the whole vocabulary in memory (issue 48).

For N action positions with hidden states h [N, H] and an output projection W [V, H]
(bias b), the logits are z = (h Wᵀ + b) / τ. The learner needs, per position,

    log π(y) = z_y − log Z,  log Z = logsumexp_v z_v,   H = log Z − E_π[z].

Taken over the whole vocabulary at once, z is an fp32 [N, V] tensor (5 GB at N = 8,192
and Qwen2.5's V = 151,936), kept for the backward pass and copied again by the softmax.
Here the vocabulary is walked in chunks of C columns: each chunk's logits are computed,
folded into a running maximum m, Σ e^{z−m} and Σ e^{z−m}·z (the online logsumexp), and
dropped; the backward pass computes them again chunk by chunk. With π = e^{z − log Z},

    ∂ log π(y) / ∂z_v = 1[v = y] − π_v,    ∂H / ∂z_v = −π_v (z_v − E_π[z]),

and the chunk's share of ∂h and ∂W follows by the chain rule through z = (h Wᵀ + b)/τ.
Peak memory is a few [N, C] tensors and no longer grows with V.

The matmuls run in `dtype` (bf16 under autocast or FSDP's bf16 parameters, as the
output projection does on the full path) and everything after them in float32, so the
numbers equal the full path's up to summation order.
"""

from __future__ import annotations

import torch
from torch import nn

CHUNK_ELEMENTS = 1 << 25  # fp32 logits per chunk (128 MB): C = CHUNK_ELEMENTS // N
MIN_CHUNK = 1024


def chunk_columns(n: int, vocab: int) -> int:
    """Vocabulary columns per chunk for `n` positions: about CHUNK_ELEMENTS logits a chunk."""
    return int(min(vocab, max(MIN_CHUNK, CHUNK_ELEMENTS // max(n, 1))))


def _logits(h, weight, bias, start: int, end: int, dtype, temperature: float) -> torch.Tensor:
    """[N, end − start] float32 logits of vocabulary columns start…end, over τ."""
    w = weight[start:end].to(dtype)
    z = h @ w.T
    if bias is not None:
        z = z + bias[start:end].to(dtype)
    return z.float() / temperature


class ChunkedLogprobs(torch.autograd.Function):
    """(log π(y), H) per position, both [N] float32, from h, W, b: see the module doc."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, dtype):
        ctx.set_materialize_grads(False)
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            n, vocab = h.shape[0], weight.shape[0]
            m = torch.full((n,), -torch.inf, device=h.device)
            s = torch.zeros(n, device=h.device)
            sz = torch.zeros(n, device=h.device)  # Σ e^{z−m}·z
            target = torch.zeros(n, device=h.device)
            for start in range(0, vocab, chunk):
                end = min(start + chunk, vocab)
                z = _logits(h, weight, bias, start, end, dtype, temperature)
                top = torch.maximum(m, z.max(1).values)
                scale = torch.exp(m - top)
                e = torch.exp(z - top[:, None])
                s = s * scale + e.sum(1)
                sz = sz * scale + (e * z).sum(1)
                m = top
                inside = (targets >= start) & (targets < end)
                at = (targets - start).clamp(0, end - start - 1)
                target = torch.where(inside, z.gather(1, at[:, None]).squeeze(1), target)
            log_z = m + torch.log(s)
            mean_z = sz / s
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, mean_z)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        return target - log_z, log_z - mean_z

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, targets, log_z, mean_z = ctx.saved_tensors
        tau, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros(hidden.shape, device=hidden.device) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            rows = torch.arange(h.shape[0], device=h.device)
            for start in range(0, weight.shape[0], chunk):
                end = min(start + chunk, weight.shape[0])
                z = _logits(h, weight, bias, start, end, dtype, tau)
                p = torch.exp(z - log_z[:, None])
                g = torch.zeros_like(z)
                if g_logp is not None:
                    g -= p * g_logp[:, None]
                    inside = (targets >= start) & (targets < end)
                    g[rows[inside], targets[inside] - start] += g_logp[inside]
                if g_entropy is not None:
                    g -= p * (z - mean_z[:, None]) * g_entropy[:, None]
                g = (g / tau).to(dtype)
                if grad_h is not None:
                    grad_h += (g @ weight[start:end].to(dtype)).float()
                if grad_w is not None:
                    grad_w[start:end] = (g.T @ h).to(weight.dtype)
                if grad_b is not None:
                    grad_b[start:end] = g.float().sum(0).to(bias.dtype)
        grad_h = grad_h.to(hidden.dtype) if grad_h is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None


def chunkable(head: nn.Module, config) -> bool:
    """Whether the output projection is a plain linear layer whose logits the model uses
    as they are (no LoRA on the head, no logit soft-capping), so the chunked path applies."""
    return type(head) is nn.Linear and not getattr(config, "final_logit_softcapping", None)


def chunked_logprobs(
    head: nn.Linear,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(targets), entropy) [N] of hidden states [N, H] through `head`; `dtype` is
    the matmul dtype (default: the head's weight dtype)."""
    dtype = dtype or head.weight.dtype
    chunk = chunk_columns(hidden.shape[0], head.weight.shape[0])
    return ChunkedLogprobs.apply(
        hidden, head.weight, head.bias, targets, float(temperature), chunk, dtype
    )

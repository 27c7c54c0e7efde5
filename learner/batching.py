"""From a batch of steps to length-bucketed, left-padded micro-batches of tensors.

Each action is scored given its prompt: the row is `prompt_ids + action_ids`, left-padded
so that every row ends in the same column. The action tokens are then the last L
columns (L = the longest action of the micro-batch), and the model only projects the
last L+1 hidden states onto the vocabulary (`logits_to_keep`), whatever the prompt
length. Rows are sorted by length and packed while rows × longest row stays within the
token budget, so padding is small. Collation is vectorised over Arrow list offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from gagpo.schemas import columns as C
from gagpo.schemas.policy import staleness


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, T] left-padded prompt + action
    attention_mask: torch.Tensor  # [b, T]
    position_ids: torch.Tensor  # [b, T] 0 at each row's first real token
    action_mask: torch.Tensor  # [b, L] True on action tokens (right-aligned)
    logp_behav: torch.Tensor  # [b, L] behaviour log-probs, 0 where masked
    advantages: torch.Tensor  # [b]
    staleness: torch.Tensor  # [b] of each row's own step (schemas.policy.staleness)
    valid: torch.Tensor  # [b] actions the loss can use (tokens, context, finite inputs)
    weight: float = 0.0  # share of the optimiser step's loss denominator (set by `plan`)

    @property
    def action_len(self) -> int:
        return self.action_mask.shape[1]

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device) -> MicroBatch:
        moved = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()
        }
        return MicroBatch(**moved)


def _lengths(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def _values(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_flatten(column).to_numpy(zero_copy_only=False)


def _place(
    out: np.ndarray,
    values: np.ndarray,
    lengths: np.ndarray,
    ends: np.ndarray,
    keep_from: np.ndarray | None = None,
) -> None:
    """Write each row's `values` into `out` so that they end at column `ends[row]`;
    with `keep_from`, only elements at index ≥ keep_from[row] of the row are written."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    pos = np.arange(len(values)) - np.repeat(starts, lengths)
    cols = np.repeat(ends - lengths, lengths) + pos
    if keep_from is not None:
        keep = pos >= np.repeat(keep_from, lengths)
        rows, cols, values = rows[keep], cols[keep], values[keep]
    out[rows, cols] = values


def collate(table: pa.Table, version: int, pad_id: int, max_positions: int) -> MicroBatch:
    """Tensors for the rows of `table` (BATCH_COLUMNS). Prompts longer than the model's
    context are cut from the left; an action with no tokens or no context is not valid."""
    p_len, a_len = _lengths(table[C.PROMPT_IDS]), _lengths(table[C.ACTION_IDS])
    # An action that alone fills the context keeps its last tokens and is not valid.
    a_keep = np.minimum(a_len, max_positions - 1)
    kept_p = np.clip(np.minimum(p_len, max_positions - a_keep), 0, None)
    n = kept_p + a_keep
    b, width, L = len(n), max(int(n.max(initial=1)), 1), max(int(a_keep.max(initial=1)), 1)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    _place(ids, _values(table[C.PROMPT_IDS]), p_len, width - a_keep, keep_from=p_len - kept_p)
    _place(ids, _values(table[C.ACTION_IDS]), a_len, np.full(b, width), keep_from=a_len - a_keep)
    attention = np.arange(width)[None, :] >= (width - n)[:, None]
    behav = np.zeros((b, L), dtype=np.float32)
    _place(
        behav, _values(table[C.BEHAVIOR_LOGPROBS]), a_len, np.full(b, L), keep_from=a_len - a_keep
    )
    action_mask = np.arange(L)[None, :] >= (L - a_keep)[:, None]
    advantages = table[C.ADVANTAGE].to_numpy().astype(np.float32)
    finite = np.isfinite(behav).all(1) & np.isfinite(advantages)
    valid = (a_len > 0) & (kept_p > 0) & (a_keep == a_len) & finite
    attention_t = torch.from_numpy(attention)
    lag = staleness(version, table[C.POLICY_VERSION].to_numpy().astype(np.int64))  # [b]
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=attention_t.long(),
        position_ids=(attention_t.long().cumsum(1) - 1).clamp(min=0),
        action_mask=torch.from_numpy(action_mask & valid[:, None]),
        logp_behav=torch.from_numpy(np.where(np.isfinite(behav), behav, 0.0).astype(np.float32)),
        advantages=torch.from_numpy(np.where(np.isfinite(advantages), advantages, 0.0)),
        staleness=torch.from_numpy(lag),
        valid=torch.from_numpy(valid),
    )


def bucket(lengths: np.ndarray, budget: int) -> list[np.ndarray]:
    """Row indices per micro-batch: longest first, packed while rows × longest ≤ budget
    (a row longer than the budget goes alone)."""
    order = np.argsort(-lengths, kind="stable")
    groups, start = [], 0
    while start < len(order):
        longest = max(int(lengths[order[start]]), 1)
        size = max(1, budget // longest)
        groups.append(order[start : start + size])
        start += size
    return groups


def plan(
    table: pa.Table,
    *,
    version: int,
    pad_id: int,
    max_positions: int,
    budget: int,
    token_mean: bool,
) -> list[MicroBatch]:
    """Micro-batches of `table`, each weighted by its share of the loss denominator
    (valid actions, or their tokens with token-mean aggregation), so that the sum of
    weighted micro-batch losses is the loss over the whole table."""
    lengths = _lengths(table[C.PROMPT_IDS]) + _lengths(table[C.ACTION_IDS])
    batches = [
        collate(table.take(idx), version, pad_id, max_positions) for idx in bucket(lengths, budget)
    ]
    counts = [float(mb.action_mask.sum() if token_mean else mb.valid.sum()) for mb in batches]
    total = max(sum(counts), 1.0)
    for mb, count in zip(batches, counts, strict=True):
        mb.weight = count / total
    return batches

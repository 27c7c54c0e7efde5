"""From a batch of steps to token-budgeted micro-batches of trajectory segments.

An agent that keeps its history sends, at step t, a prompt that holds steps 0…t−1: scored
as one row per step (`prompt_ids + action_ids`), a trajectory of T turns costs O(T²)
tokens. So each trajectory (traj_id, by step) is split into **segments**: a step joins the
current segment when its `prompt_ids` begin exactly with the previous step's
`prompt_ids + action_ids`, otherwise it starts a new one. A segment's tokens are its last
step's `prompt_ids + action_ids`, which hold every earlier step of the segment unchanged;
action k of the segment sits at columns [len(prompt_k), len(prompt_k) + len(action_k)).
Each segment is one right-padded row, encoded once, and every action's log-probs are read
at its own positions (`action_logprobs` projects only the hidden states that predict an
action token onto the vocabulary), so each action is scored on exactly the context it was
sampled on. With merging off every step is its own segment: the same code, one row per step.

A step longer than the model's context (`max_positions`) is never cut: it is not encoded
and not in the loss (learner/update.py counts it, metric `context_skipped`). Segments are
sorted by length and packed while rows × longest row stays within the token budget.
Collation is vectorised over Arrow list offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from gagpo.schemas import columns as C
from gagpo.schemas.extends import extends_rows, same_trajectory
from gagpo.schemas.policy import staleness


@dataclass
class MicroBatch:
    """Rows are segments [b, T]; the action tensors are per action [A, L] and [A]."""

    input_ids: torch.Tensor  # [b, T] segment tokens, right-padded
    attention_mask: torch.Tensor  # [b, T]
    position_ids: torch.Tensor  # [b, T] 0 at each row's first token
    token_rows: torch.Tensor  # [N] row of each action token the loss reads (action_mask order)
    token_cols: torch.Tensor  # [N] the column whose hidden state predicts it (its own − 1)
    action_mask: torch.Tensor  # [A, L] True on the action tokens read (left-aligned), valid only
    logp_behav: torch.Tensor  # [A, L] behaviour log-probs, 0 where masked
    advantages: torch.Tensor  # [A]
    staleness: torch.Tensor  # [A] of each action's own step (schemas.policy.staleness)
    valid: torch.Tensor  # [A] actions the loss can use (tokens, context, finite inputs)
    weight: float = 0.0  # share of the optimiser step's loss denominator (set by `plan`)
    # A prefix trie's rows (learner/trie.py) instead of segments: which earlier column each
    # column attends to [b, T, T] (True: attend), and the token each read position predicts
    # [N] (in a trie it is not the next column). None: segments, causal, input_ids[r, c + 1].
    tree_mask: torch.Tensor | None = None
    token_targets: torch.Tensor | None = None

    @property
    def action_len(self) -> int:
        return self.action_mask.shape[1]

    @property
    def tokens(self) -> int:
        """Tokens encoded (padding excluded)."""
        return int(self.attention_mask.sum())

    @property
    def segments(self) -> int:
        return self.input_ids.shape[0]

    def targets(self) -> torch.Tensor:
        """[N] the token each read position predicts."""
        if self.token_targets is not None:
            return self.token_targets
        return self.input_ids[self.token_rows, self.token_cols + 1]

    def model_attention_mask(self) -> torch.Tensor:
        """The mask the model takes: the padding mask [b, T] of segments (causal inside),
        or a trie's [b, 1, T, T] boolean mask, which transformers passes as it is."""
        return self.attention_mask if self.tree_mask is None else self.tree_mask[:, None]

    def to(self, device: torch.device) -> MicroBatch:
        moved = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()
        }
        return MicroBatch(**moved)


def _lengths(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def _values(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_flatten(column).to_numpy(zero_copy_only=False)


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Offset of each row's first element in the flattened values."""
    return np.cumsum(lengths) - lengths


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows of `lengths` elements beginning at `starts` in some flat values: the row of
    each element, its index within its row, and its index into the flat values."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(_starts(lengths), lengths)
    return owner, within, np.repeat(starts, lengths) + within


def step_lengths(table: pa.Table) -> np.ndarray:
    """[steps] tokens of each step's `prompt_ids + action_ids`."""
    return _lengths(table[C.PROMPT_IDS]) + _lengths(table[C.ACTION_IDS])


@dataclass
class Segments:
    """The steps of a table sorted by (group, trajectory, step), as flat arrays, and their
    segmentation."""

    prompt_len: np.ndarray  # [steps]
    action_len: np.ndarray  # [steps]
    tokens: np.ndarray  # every step's prompt + action, flattened step after step
    behav: np.ndarray  # the behaviour log-probs, flattened
    advantages: np.ndarray  # [steps]
    versions: np.ndarray  # [steps] policy version of each step
    segment: np.ndarray  # [steps] segment of each step; −1: not encoded (empty or too long)
    group: np.ndarray  # [steps] index of each step's group (ascending group_id)
    last: np.ndarray  # [segments] the step whose prompt + action are the segment's tokens

    @property
    def lengths(self) -> np.ndarray:
        """[segments] tokens of each segment."""
        return self.prompt_len[self.last] + self.action_len[self.last]


def _tokens(table: pa.Table, p_len: np.ndarray, a_len: np.ndarray) -> np.ndarray:
    """Every step's `prompt_ids + action_ids`, flattened step after step."""
    n = p_len + a_len
    out = np.empty(int(n.sum()), dtype=np.int64)
    starts = _starts(n)
    out[_ranges(starts, p_len)[2]] = _values(table[C.PROMPT_IDS])
    out[_ranges(starts + p_len, a_len)[2]] = _values(table[C.ACTION_IDS])
    return out


def segment(table: pa.Table, max_positions: int, merge: bool = True) -> Segments:
    """Split each trajectory into segments whose prompts extend each other (module doc).
    A step that is empty or longer than `max_positions` is in none, and the next step
    starts a new one; with `merge` off every other step is a segment of its own."""
    order = pc.sort_indices(
        table, [(C.GROUP_ID, "ascending"), (C.TRAJ_ID, "ascending"), (C.STEP, "ascending")]
    )
    table = table.take(order)
    p_len, a_len = _lengths(table[C.PROMPT_IDS]), _lengths(table[C.ACTION_IDS])
    n = p_len + a_len
    tokens = _tokens(table, p_len, a_len)
    encoded = (n > 0) & (n <= max_positions)
    joins = np.zeros(len(n), dtype=bool)
    if merge:
        same = same_trajectory(
            table[C.GROUP_ID].to_numpy(zero_copy_only=False),
            table[C.TRAJ_ID].to_numpy(zero_copy_only=False),
        )
        extends = extends_rows(same, tokens, p_len, n)  # the one rule (schemas/extends.py)
        joins = extends & encoded & np.roll(encoded, 1)
    seg = np.where(encoded, np.cumsum(encoded & ~joins) - 1, -1)
    steps = np.flatnonzero(encoded)
    ends = np.r_[seg[steps][1:] != seg[steps][:-1], True] if len(steps) else np.zeros(0, bool)
    return Segments(
        prompt_len=p_len,
        action_len=a_len,
        tokens=tokens,
        behav=_values(table[C.BEHAVIOR_LOGPROBS]).astype(np.float32),
        advantages=table[C.ADVANTAGE].to_numpy().astype(np.float32),
        versions=table[C.POLICY_VERSION].to_numpy().astype(np.int64),
        segment=seg,
        group=pc.index_in(table[C.GROUP_ID], pc.unique(table[C.GROUP_ID])).to_numpy(),
        last=steps[ends],
    )


def collate(segs: Segments, chosen: np.ndarray, version: int, pad_id: int) -> MicroBatch:
    """Tensors for segments `chosen` of `segs` and every action in them. An action with no
    tokens, no context or non-finite inputs is not valid."""
    p_len, a_len = segs.prompt_len, segs.action_len
    lengths = segs.lengths[chosen]
    b, width = len(chosen), max(int(lengths.max(initial=1)), 1)
    owner, col, at = _ranges(_starts(p_len + a_len)[segs.last[chosen]], lengths)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    ids[owner, col] = segs.tokens[at]
    attention = np.arange(width)[None, :] < lengths[:, None]

    row_of = np.full(len(segs.last) + 1, -1)  # segment → row here; index −1: not encoded
    row_of[chosen] = np.arange(b)
    steps = np.flatnonzero(row_of[segs.segment] >= 0)
    rows, p = row_of[segs.segment[steps]], p_len[steps]
    act, j, read, fields = action_tensors(segs, steps, version)
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attention).long(),
        position_ids=torch.arange(width).expand(b, width).contiguous(),
        token_rows=torch.from_numpy(rows[act][read]),
        token_cols=torch.from_numpy((p[act] + j - 1)[read]),
        **fields,
    )


def action_tensors(segs: Segments, steps: np.ndarray, version: int):
    """The per-action tensors of `steps` (MicroBatch's action_mask, logp_behav, advantages,
    staleness, valid), and for each of their action tokens its action, its index in it, and
    whether the loss reads it (in action_mask's row-major order)."""
    p, a = segs.prompt_len[steps], segs.action_len[steps]
    A, L = len(steps), max(int(a.max(initial=1)), 1)
    act, j, at = _ranges(_starts(segs.action_len)[steps], a)  # each action token
    behav = np.zeros((A, L), dtype=np.float32)
    behav[act, j] = segs.behav[at]
    advantages = segs.advantages[steps]
    finite = np.isfinite(behav).all(1) & np.isfinite(advantages)
    valid = (a > 0) & (p > 0) & finite
    fields = dict(
        action_mask=torch.from_numpy((np.arange(L)[None, :] < a[:, None]) & valid[:, None]),
        logp_behav=torch.from_numpy(np.where(np.isfinite(behav), behav, 0.0).astype(np.float32)),
        advantages=torch.from_numpy(np.where(np.isfinite(advantages), advantages, 0.0)),
        staleness=torch.from_numpy(staleness(version, segs.versions[steps])),
        valid=torch.from_numpy(valid),
    )
    return act, j, valid[act], fields


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
    merge: bool = True,
) -> list[MicroBatch]:
    """Micro-batches of `table`'s segments, each weighted by its share of the loss
    denominator (valid actions, or their tokens with token-mean aggregation), so that the
    sum of weighted micro-batch losses is the loss over the whole table. Steps past the
    context are in none (the update counts them, `context_skipped`)."""
    segs = segment(table, max_positions, merge)
    batches = [collate(segs, idx, version, pad_id) for idx in bucket(segs.lengths, budget)]
    weigh(batches, token_mean)
    return batches


def weigh(batches: list[MicroBatch], token_mean: bool) -> None:
    """Each micro-batch's share of the loss denominator: its valid actions, or with
    token-mean aggregation their tokens, over the whole table's."""
    counts = [float(mb.action_mask.sum() if token_mean else mb.valid.sum()) for mb in batches]
    total = max(sum(counts), 1.0)
    for mb, count in zip(batches, counts, strict=True):
        mb.weight = count / total

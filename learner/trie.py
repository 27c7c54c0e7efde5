"""A group's steps as one prefix trie: each distinct prefix encoded once (issue 48).

The G rollouts of a group begin from one prompt and revisit states, and an agent that
keeps its history sends, at step t, a prompt that holds steps 0…t−1. Segments
(learner/batching.py) encode each trajectory once but every trajectory's copy of what
the group shares again. Here the sequences `prompt_ids + action_ids` of a group's steps
are laid out as the trie of their prefixes: a **node** is a distinct prefix (group,
depth d, tokens t_0…t_d), a row holds nodes, and

- node i attends to node j iff j is an ancestor of i or i itself (a boolean [T, T] mask,
  which transformers passes to SDPA/eager attention as it is);
- its position id is its depth d, so along each path positions run 0, 1, 2, … exactly as
  in the step's own row;
- the log-prob of action token k of a step with prompt length p is read at the node of
  the step's prefix of length p + k (its depth p + k − 1) and its target is the step's
  token p + k.

So every action is scored on exactly the context it was sampled on: the same keys,
values and positions as its segment row, only fewer tokens. Rows are laid out by depth,
so along each path the keys keep their order (up to the attention kernel's blocking, the
sums are the segment row's).

Nodes come from a polynomial hash of each prefix (two 31-bit moduli, vectorised as a
cumulative sum over the flat tokens), checked exactly: every occurrence of a node must
carry the node's token and the node's parent, so by induction on depth two prefixes
share a node only if they are equal (a collision fails loudly, never silently).

A group's trie is one row unless it holds more than the micro-batch budget: then the
group's segments (a trajectory's steps that extend each other: one path) are split, in
(trajectory, step) order, into rows that each hold whole paths; a prefix shared across two rows is encoded in both (a split at trie nodes, never
inside a prefix), and `splits` counts the extra rows. Positions are depths, so a row is
never limited by the model's context, only its paths are (steps past it are left out
as with segments). Rows are packed into micro-batches as segments are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from gagpo.learner.batching import (
    MicroBatch,
    Segments,
    _ranges,
    _starts,
    action_tensors,
    bucket,
    segment,
    weigh,
)
from gagpo.schemas.errors import GagpoError

_MODULI = (2_147_483_647, 2_147_483_629)  # primes below 2³¹
_BASES = (1_000_003, 911_382_323)


@dataclass
class Trie:
    """The encoded steps' tokens (step after step, each step's tokens in order) and the
    node of each; node ids ascend with (group, depth)."""

    flat: np.ndarray  # [tokens] index of each token into `Segments.tokens`
    step: np.ndarray  # [tokens] its step
    depth: np.ndarray  # [tokens] its index within the step's prompt + action
    node: np.ndarray  # [tokens] its node
    nodes: int


@dataclass
class TrieStats:
    """What the trie saved: `segment_tokens` (what segments encode), `tokens` (what the
    trie rows encode), `distinct` (the groups' distinct prefixes) and `splits` (rows past
    one per group, made by the budget)."""

    segment_tokens: int = 0
    tokens: int = 0
    distinct: int = 0
    splits: int = 0

    def add(self, other: TrieStats) -> None:
        for key, value in vars(other).items():
            setattr(self, key, getattr(self, key) + value)


def _powers(n: int, base: int, mod: int) -> np.ndarray:
    """[n] base^k mod `mod`, by doubling (products stay below 2⁶²)."""
    out = np.ones(1, dtype=np.int64)
    while len(out) < n:
        out = np.concatenate([out, out * pow(base, len(out), mod) % mod])
    return out[:n]


def build(segs: Segments) -> Trie:
    """The prefix trie of the encoded steps (segment ≥ 0) of each group."""
    n = segs.prompt_len + segs.action_len
    steps = np.flatnonzero(segs.segment >= 0)
    owner, depth, flat = _ranges(_starts(n)[steps], n[steps])
    step = steps[owner]
    tok = segs.tokens[flat].astype(np.int64)
    group = segs.group[step].astype(np.int64)
    first = _starts(n[steps])[owner]  # each token's step's first token, in these arrays
    hashed = np.zeros(len(tok), dtype=np.int64)
    for base, mod in zip(_BASES, _MODULI, strict=True):
        term = (tok + 1) % mod * _powers(int(depth.max(initial=0)) + 1, base, mod)[depth] % mod
        total = np.cumsum(term)  # < 2⁵² for up to 2²¹ tokens per 2³¹
        hashed = (hashed << 31) | ((total - total[first] + term[first]) % mod)
    order = np.lexsort((hashed, depth, group))  # node ids ascend with (group, depth)
    new = np.zeros(len(order), dtype=bool)  # where a sorted key differs from the one before
    new[:1] = True
    for key in (group, depth, hashed):
        ordered = key[order]
        new[1:] |= ordered[1:] != ordered[:-1]
    node = np.empty(len(order), dtype=np.int64)
    node[order] = np.cumsum(new) - 1
    index = order[new]  # one occurrence of each node
    parent = np.where(depth > 0, np.r_[-1, node[:-1]], -1)  # the previous token's node
    if (tok[index][node] != tok).any() or (parent[index][node] != parent).any():
        raise GagpoError("prefix trie: two different prefixes share a hash; this batch cannot use")
    return Trie(flat=flat, step=step, depth=depth, node=node, nodes=len(index))


def rows(
    segs: Segments, trie: Trie, budget: int, kappa: float | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
    """Row of each encoded step, each row's distinct tokens, and the splits made by the
    budget. A group's segments (learner/batching.py: a trajectory's steps that extend each
    other, one path of the trie) join its current row, in (trajectory, step) order, while
    the row's distinct nodes stay within `budget` (a segment alone may exceed it) and,
    given `kappa`, while joining is cheaper than a row of its own. A segment is never
    split, so a row never holds more tokens than its segments would.

    The cost: a row of T tokens costs κ·T + T² (dense-masked attention: T² query-key
    pairs; κ: one token's linear layers in pairs, `pair_cost`). A segment of L tokens, n of
    them new to a row of S, joins when κ·n + 2·S·n + n² < κ·L + L²: a segment that shares
    nothing never joins, one that shares most of itself does until the row is long."""
    bounds = np.r_[0, np.flatnonzero(np.diff(trie.step)) + 1, len(trie.step)]
    lo = np.zeros(len(segs.segment), dtype=np.int64)
    lo[trie.step[bounds[:-1]]] = bounds[:-1]
    hi = lo.copy()
    hi[trie.step[bounds[:-1]]] = bounds[1:]
    stamp = np.full(trie.nodes, -1)
    row_of_segment = np.zeros(len(segs.last), dtype=np.int64)
    sizes, row, group, splits = [], -1, None, 0
    for s, last in enumerate(segs.last):
        nodes = trie.node[lo[last] : hi[last]]  # the segment's path: its last step's
        if segs.group[last] != group:
            row, group = row + 1, segs.group[last]
            sizes.append(0)
        new = int(np.count_nonzero(stamp[nodes] != row))
        size, n = sizes[-1], len(nodes)
        over = size + new > budget
        dearer = kappa is not None and kappa * new + 2 * size * new + new**2 >= kappa * n + n**2
        if size and (over or dearer):
            row, new, splits = row + 1, n, splits + over
            sizes.append(0)
        stamp[nodes] = row
        sizes[-1] += new
        row_of_segment[s] = row
    row_of = np.where(segs.segment >= 0, row_of_segment[segs.segment], -1)
    return row_of, np.asarray(sizes, dtype=np.int64), splits


def pair_cost(config) -> float:
    """κ of a transformers model config: one token's linear layers, in attended
    query-key pairs. Per layer a token costs about 24·h² FLOPs in its projections and MLP
    (and 2·h·V / layers of the head) and a pair about 4·h (QKᵀ and AV): κ ≈ 6·h + V/(2·n)."""
    h = int(getattr(config, "hidden_size", 1024))
    layers = max(int(getattr(config, "num_hidden_layers", 1)), 1)
    return 6.0 * h + int(getattr(config, "vocab_size", 0)) / (2.0 * layers)


def _ancestors(paths: np.ndarray, on: np.ndarray, lengths, depth, positions) -> torch.Tensor:
    """[b, T, T] node i attends to j iff j is i or an ancestor of i: j lies on the path of
    a step through i (`paths` [steps, T], `on` [nodes] such a step) at a depth ≤ i's.
    A row's nodes are its first columns, in order; padding columns attend to themselves."""
    b, width = positions.shape
    mask = torch.zeros((b, width, width), dtype=torch.bool)
    paths, on, depth = torch.from_numpy(paths), torch.from_numpy(on), torch.from_numpy(depth)
    positions = torch.from_numpy(positions)
    start = 0
    for row, n in enumerate(lengths.tolist()):
        nodes = slice(start, start + n)
        mask[row, :n] = paths[on[nodes]] & (positions[row][None, :] <= depth[nodes][:, None])
        pad = torch.arange(n, width)
        mask[row, pad, pad] = True
        start += n
    return mask


def collate(
    segs: Segments, trie: Trie, row_of: np.ndarray, chosen: np.ndarray, version: int, pad_id: int
) -> MicroBatch:
    """Tensors for trie rows `chosen` and every action in them (see the module doc)."""
    b = len(chosen)
    here = np.full(int(row_of.max(initial=-1)) + 2, -1)  # row → index here; −1 (last): none
    here[chosen] = np.arange(b)
    sel = np.flatnonzero(here[row_of[trie.step]] >= 0)  # whole steps, in order
    r_tok = here[row_of[trie.step[sel]]]
    pairs, first, inv = np.unique(
        r_tok * trie.nodes + trie.node[sel], return_index=True, return_inverse=True
    )
    r = pairs // trie.nodes
    c = np.arange(len(pairs)) - np.searchsorted(r, r)  # nodes by id: by depth within a row
    col = c[inv.reshape(-1)]  # column of each selected token
    depth = trie.depth[sel]
    lengths = np.bincount(r, minlength=b)
    width = max(int(lengths.max(initial=1)), 1)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    ids[r, c] = segs.tokens[trie.flat[sel][first]]
    positions = np.zeros((b, width), dtype=np.int64)
    positions[r, c] = depth[first]

    steps = np.unique(trie.step[sel])
    step_first = np.searchsorted(trie.step[sel], steps)  # a step's first token, in `sel`
    step_here = np.searchsorted(steps, trie.step[sel])  # each token's step, as 0…len(steps)
    paths = np.zeros((len(steps), width), dtype=bool)
    paths[step_here, col] = True  # each step's path, over its row's columns
    act, j, read, fields = action_tensors(segs, steps, version)
    at = step_first[act] + segs.prompt_len[steps][act] + j  # the action token, in `sel`
    at = at[read]
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(np.arange(width)[None, :] < lengths[:, None]).long(),
        position_ids=torch.from_numpy(positions),
        token_rows=torch.from_numpy(r_tok[at]),
        token_cols=torch.from_numpy(col[at - 1]),  # the node of the prefix before it
        token_targets=torch.from_numpy(segs.tokens[trie.flat[sel][at]].astype(np.int64)),
        tree_mask=_ancestors(paths, step_here[first], lengths, depth[first], positions),
        **fields,
    )


def plan(
    table: pa.Table,
    *,
    version: int,
    pad_id: int,
    max_positions: int,
    budget: int,
    token_mean: bool,
    merge: bool = True,
    kappa: float | None = None,
) -> tuple[list[MicroBatch], TrieStats]:
    """Micro-batches of `table`'s prefix-trie rows, weighted as `batching.plan` weighs
    segments, and what the trie saved against the segments of `merge`. With `kappa`
    (`pair_cost` of the model) a segment joins a row only where that is cheaper (`rows`)."""
    segs = segment(table, max_positions, merge)
    trie = build(segs)
    row_of, sizes, splits = rows(segs, trie, budget, kappa)
    batches = [collate(segs, trie, row_of, idx, version, pad_id) for idx in bucket(sizes, budget)]
    weigh(batches, token_mean)
    stats = TrieStats(
        segment_tokens=int(segs.lengths.sum()),
        tokens=int(sizes.sum()),
        distinct=trie.nodes,
        splits=splits,
    )
    return batches, stats

"""State grouping: which steps of a group share one value-proxy pool (docs/design.md §4.2).

    group_states(grouping, gid, state_key, query_gid, query_key) -> Pools

maps every step's (group, state_key) to a pool, and every query (group, next_state_key of a
truncated end) to the pool that key falls in, or NO_POOL. Pools never cross groups. The
advantage stage runs it inside its lazy plan, before the value proxy, so any stored run
can be recomputed under another grouping (`[advantages] state_grouping`, or
`gagpo advantages --state-grouping MODE`). Modes:

exact
    equal strings (today's rule, the default): the pools of `pools.pool_ids`, bit for bit.
normalized[:module:function]
    equal canonical keys. The built-in canonical key lowercases the key, turns every run
    of digits into `#` (counters, step numbers, prices) and every run of whitespace into
    one space, and strips the ends (`canonical_keys`, Polars regexes; run as byte work on
    one key per exact pool, `canonical_keys_fast`, equal string for string). `normalized:
    pkg.mod:fn` uses `fn(str) -> str` instead, called once per distinct key (user Python).
similar:τ
    verl-agent's similarity grouping for GiGPO (gigpo/core_gigpo.py, `build_step_group`
    with `enable_similarity`): within one group, rows are taken in input row order, and
    a row joins the first cluster, in creation order, whose *first member* `rep` has
    `difflib.SequenceMatcher(None, key, rep).ratio() >= τ`; otherwise it starts a cluster.
    Its quirks are kept: the result depends on row order; the ratio is not symmetric
    (the row's key is `a`, the representative `b`, with difflib's autojunk on `b`), and a
    pool is not transitive (two members may be far apart). Equal keys always land in
    one cluster, so the rule runs on each group's distinct keys in first-occurrence
    order, and difflib's cheaper upper bounds (real_quick_ratio, quick_ratio) skip a
    pair only when they already fall below τ: the same clusters, far fewer ratios. This
    is a per-group Python map (difflib is Python): O(distinct keys × clusters) ratios
    per group; see benchmarks/RESULTS.md for what it costs.
minhash:τ
    ours, order-independent and vectorised: two distinct keys of a group are linked when
    their one-permutation MinHash sketches (64 bins over byte 4-gram shingles) share an
    LSH band bucket, one of them is that bucket's least key (string order: a star per
    bucket, not all pairs, which would be quadratic in a bucket of near-duplicates), and
    they estimate a Jaccard similarity ≥ τ; pools are the connected components of the
    links. Nothing depends on row order (the sketches and links depend only on the strings
    and their groups), so a shuffled batch gets the same pools. It runs on one key per
    exact pool, over blocks of whole groups (arrays that stay in cache).

A truncated end's `next_state_key` is mapped through the same grouping: its exact pool when
the group visited that key; otherwise, for `normalized` the pool of its canonical key, for
`similar` the first cluster whose representative it matches, for `minhash` the pool of
the linked key with the highest estimated similarity (ties: the smallest key); NO_POOL
when nothing matches. Each pool is labelled (`Pools.label`, the SQL views' `pool_id`) by a
key: the state key (exact), the canonical key (normalized), the cluster's first member
(similar), the component's smallest key (minhash).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from difflib import SequenceMatcher

import numpy as np
import polars as pl

from gagpo.pipeline.pools import NO_POOL, pool_ids
from gagpo.pipeline.scan import INDEX
from gagpo.schemas.errors import GagpoError

MODES = ("exact", "normalized", "similar", "minhash")
MODES_HELP = (
    "exact, normalized, normalized:MODULE:FUNCTION, similar:TAU, minhash:TAU (0 < TAU <= 1)"
)

# minhash parameters: byte shingles, sketch bins, and the recall asked of the LSH bands
# for a pair exactly at τ (the band size r is the largest power of 2 that keeps it).
SHINGLE = 4
BINS = 64
RECALL_AT_TAU = 0.999
_EMPTY = np.uint32(0xFFFFFFFF)  # an empty sketch bin
_MIX_SEED = np.uint64(0x9E3779B97F4A7C15)
_CHUNK_BYTES = 1 << 18  # shingles hashed per pass: arrays that stay in cache
_BLOCK_KEYS = 2048  # minhash works over blocks of whole groups of about this many keys


# --- the setting ---------------------------------------------------------------------


@dataclass(frozen=True)
class Grouping:
    """A parsed `state_grouping` value: the mode, τ for similar/minhash, and the user
    function (`module:function`) for normalized."""

    mode: str = "exact"
    threshold: float | None = None
    function: str | None = None

    @property
    def spec(self) -> str:
        """The canonical text of the setting (what configs and file metadata hold)."""
        if self.threshold is not None:
            return f"{self.mode}:{self.threshold:g}"
        if self.function is not None:
            return f"{self.mode}:{self.function}"
        return self.mode

    @property
    def tag(self) -> str:
        """The spec with `:` as `_`, for the `advantages/<tag>/` folder name."""
        return self.spec.replace(":", "_")


def parse_grouping(text: str) -> Grouping:
    """`exact`, `normalized`, `normalized:MODULE:FUNCTION`, `similar:TAU`, `minhash:TAU`."""
    text = str(text).strip()
    mode, _, arg = text.partition(":")
    if mode not in MODES:
        raise GagpoError(f"unknown state_grouping {text!r}; accepted: {MODES_HELP}")
    if mode == "exact":
        if arg:
            raise GagpoError(f"state_grouping {text!r}: exact takes no argument")
        return Grouping()
    if mode == "normalized":
        if not arg:
            return Grouping("normalized")
        module, _, name = arg.partition(":")
        if not module or not name:
            raise GagpoError(
                f"state_grouping {text!r}: accepted: normalized:MODULE:FUNCTION (e.g. "
                "normalized:mypkg.keys:canonical)"
            )
        return Grouping("normalized", function=arg)
    try:
        tau = float(arg)
    except ValueError:
        tau = math.nan
    if not 0.0 < tau <= 1.0:
        raise GagpoError(f"state_grouping {text!r}: accepted: {mode}:TAU with 0 < TAU <= 1")
    return Grouping(mode, threshold=tau)


def load_function(spec: str) -> Callable[[str], str]:
    """The user's canonical-key function `module:function`, as one error line if missing."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise GagpoError(
            f"state_grouping normalized:{spec}: cannot load {name!r} from {module!r} ({exc})"
        ) from None
    if not callable(fn):
        raise GagpoError(f"state_grouping normalized:{spec}: {spec} is not callable")
    return fn


# --- the pools -------------------------------------------------------------------------


@dataclass(frozen=True)
class Pools:
    """`pool`: dense pool id of every row; `query_pool`: the pool of every query (NO_POOL
    where none matches); `label()`: one key per pool id, its readable name (computed on
    demand: exact pools cost nothing more than before)."""

    pool: np.ndarray
    query_pool: np.ndarray
    names: pl.Series
    rows: Callable[[], np.ndarray]  # index into `names` of each pool's label

    def label(self) -> pl.Series:
        return self.names.gather(self.rows())


def canonical_keys(keys: pl.Series) -> pl.Series:
    """The built-in `normalized` key: lowercase, digit runs → `#`, whitespace runs → one
    space, ends stripped."""
    return (
        keys.str.to_lowercase()
        .str.replace_all(r"\d+", "#")
        .str.replace_all(r"\s+", " ")
        .str.strip_chars()
    )


def _first_rows(pool: np.ndarray) -> np.ndarray:
    """Row index of each pool's first row (pool ids are dense)."""
    first = np.full(int(pool.max()) + 1 if pool.size else 0, pool.shape[0], INDEX)
    np.minimum.at(first, pool, np.arange(pool.shape[0], dtype=INDEX))
    return first


def _relabel(merged: np.ndarray, pool: np.ndarray, query_pool: np.ndarray):
    """Rows and queries through `merged` (exact pool → representative exact pool), with
    dense ids again; and the representative exact pool of each new id."""
    reps, dense = np.unique(merged, return_inverse=True)
    dense = dense.astype(INDEX)
    query = np.where(query_pool == NO_POOL, NO_POOL, dense[np.maximum(query_pool, 0)])
    return dense[pool], query.astype(INDEX), reps


def group_states(
    grouping: Grouping,
    gid: np.ndarray,
    state_key: pl.Series,
    query_gid: np.ndarray,
    query_key: pl.Series,
) -> Pools:
    """The pools of every row's (group, state_key) and of every query under `grouping`.

    Every mode starts from the exact pools (one hash sort over the rows) and then works on
    one key per exact pool: a group's rollouts revisit states, so there are fewer of them
    than rows, and nothing a mode computes is repeated for a key's every visit."""
    pool, query_pool = pool_ids(gid, state_key, query_gid, query_key)
    if grouping.mode == "exact" or pool.size == 0:
        return Pools(pool, query_pool, state_key, lambda: _first_rows(pool))
    first = _first_rows(pool)
    key = state_key.gather(first)  # one key per exact pool
    key_gid = gid[first]
    missing = np.flatnonzero(query_pool == NO_POOL)  # queries the group never visited verbatim
    queries = (query_key.gather(missing), query_gid[missing])
    if grouping.mode == "normalized":
        merged, found, key = _normalized(key, key_gid, grouping.function, *queries)
    elif grouping.mode == "similar":
        merged, found = _similar(key, key_gid, first, grouping.threshold, *queries)
    else:
        merged, found = _minhash(key, key_gid, grouping.threshold, *queries)
    query_pool = query_pool.copy()
    query_pool[missing] = found
    pool, query_pool, reps = _relabel(merged, pool, query_pool)
    return Pools(pool, query_pool, key, lambda: reps)


# --- normalized ------------------------------------------------------------------------

# Per byte: its kind (1 digit, 2 whitespace: the ASCII part of Unicode White_Space, which
# is what the regexes' \s and strip mean) and its canonical byte (lowercase, `#`, space).
_KIND = np.zeros(256, np.uint8)
_KIND[48:58] = 1
_KIND[[9, 10, 11, 12, 13, 32]] = 2
_CANON = np.arange(256, dtype=np.uint8)
_CANON[65:91] += 32
_CANON[48:58] = ord("#")
_CANON[[9, 10, 11, 12, 13, 32]] = ord(" ")


def canonical_keys_fast(keys: pl.Series) -> pl.Series:
    """`canonical_keys`, equal string for string, as byte work on the keys' UTF-8 buffer:
    for ASCII the rule is bytewise (A–Z lowercased; a digit or whitespace byte whose
    predecessor in the same key is one too is dropped, the run's first byte becomes `#`
    or a space; then one space at either end goes). Keys with any non-ASCII byte (where
    Unicode case, digits and spaces apply) go through `canonical_keys` itself."""
    import pyarrow as pa

    n = keys.len()
    if n == 0:
        return keys.cast(pl.String)
    valid = keys.is_not_null().to_numpy()
    data, offsets = _utf8(keys.fill_null(""))
    data = data[offsets[0] : offsets[-1]]
    offsets = offsets - offsets[0]
    m = int(offsets[-1])
    starts = np.zeros(m + 1, bool)  # the first byte of a key
    starts[offsets[:-1]] = True
    starts = starts[:m]
    kind = _KIND[data]  # 0 other, 1 digit, 2 whitespace
    keep = np.ones(m, bool)
    if m:
        np.not_equal(kind[1:], kind[:-1], out=keep[1:])
        keep[1:] |= kind[1:] == 0
        keep |= starts
    keep &= ~((kind == 2) & starts)  # a leading space (runs are one byte by now)
    out = _CANON[data]
    # (a cumulative sum of bytes as int32 where it fits: numpy's int64 sum of a bool or
    # uint8 array is many times slower)
    total = np.int32 if m < 2**31 else np.int64
    kept = np.zeros(m + 1, total)
    np.cumsum(keep.view(np.uint8), dtype=total, out=kept[1:])
    new_offsets = kept[offsets]
    out = out[keep]
    new_lengths = np.diff(new_offsets)
    last = new_offsets[1:] - 1
    trailing = (new_lengths > 0) & (out[np.maximum(last, 0)] == 32) if out.size else new_lengths > 0
    if trailing.any():  # a trailing space: one byte at the end of those keys
        drop = np.ones(out.shape[0], bool)
        drop[last[trailing]] = False
        out = out[drop]
        new_offsets = new_offsets - np.concatenate(([0], np.cumsum(trailing, dtype=np.int64)))
    null_mask = None if valid.all() else pa.array(valid).buffers()[1]
    arrow = pa.LargeStringArray.from_buffers(
        n, pa.py_buffer(new_offsets.astype(np.int64)), pa.py_buffer(out), null_mask
    )
    result = pl.Series(keys.name, arrow)
    ascii_ = np.ones(n, bool)
    wide = np.flatnonzero(data >= 128)
    if wide.size:  # the keys holding those bytes: Unicode rules
        ascii_[np.unique(np.searchsorted(offsets, wide, "right") - 1)] = False
    if not ascii_.all():
        other = np.flatnonzero(~ascii_ & valid)
        result = result.scatter(other, canonical_keys(keys.gather(other)))
    return result


def _normalized(
    key: pl.Series,
    key_gid: np.ndarray,
    function: str | None,
    query_key: pl.Series,
    query_gid: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, pl.Series]:
    """Each exact pool's merged pool (equal canonical keys in a group), the pool of each
    query's canonical key (NO_POOL if none), and the canonical key of each exact pool."""
    if function is None:
        canon = canonical_keys_fast(key)
        q_canon = canonical_keys_fast(query_key)
    else:
        canon, q_canon = _map_distinct(key, load_function(function), query_key)
    merged, found = pool_ids(key_gid, canon, query_gid, q_canon)
    rep = _first_rows(merged)  # each (group, canonical key): its first exact pool
    found = np.where(found == NO_POOL, NO_POOL, rep[np.maximum(found, 0)])
    return rep[merged].astype(INDEX), found.astype(INDEX), canon


def _map_distinct(
    keys: pl.Series, fn: Callable[[str], str], queries: pl.Series
) -> tuple[pl.Series, pl.Series]:
    """`fn` applied once per distinct key of keys and queries (user Python), mapped back."""
    both = pl.concat([keys, queries.cast(pl.String)])
    distinct = both.drop_nulls().unique()
    mapped = pl.Series([fn(k) for k in distinct.to_list()], dtype=pl.String)
    out = both.replace_strict(distinct, mapped, default=None, return_dtype=pl.String)
    return out.head(keys.len()), out.tail(queries.len())


# --- similar:τ (verl-agent) -------------------------------------------------------------


def _similar(
    key: pl.Series,
    key_gid: np.ndarray,
    first: np.ndarray,
    tau: float,
    query_key: pl.Series,
    query_gid: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """verl-agent's greedy first-fit, per group, over its exact pools in the order of
    their first rows. Returns each exact pool's cluster (the exact pool of the cluster's
    first member) and the cluster each query first fits (NO_POOL if none).

    A Python loop over groups and their distinct keys: difflib is Python, and first-fit
    is sequential by definition (documented in the module docstring)."""
    order = np.lexsort((first, key_gid))  # by group, then by first occurrence
    merged = np.arange(key.len(), dtype=INDEX)
    keys, q_keys = key.to_list(), query_key.to_list()
    q_order = np.argsort(query_gid, kind="stable")
    q_groups = query_gid[q_order]
    found = np.full(query_gid.shape[0], NO_POOL, INDEX)
    for members in np.split(order, np.flatnonzero(np.diff(key_gid[order])) + 1):
        reps: list[tuple[int, SequenceMatcher]] = []  # (pool, matcher with b = its rep)
        for p in members.tolist():
            hit = _first_fit(keys[p], reps, tau)
            if hit is None:
                reps.append((p, SequenceMatcher(None, "", keys[p])))
            else:
                merged[p] = hit
        g = key_gid[members[0]]
        lo, hi = np.searchsorted(q_groups, [g, g + 1])
        for q in q_order[lo:hi].tolist():
            hit = _first_fit(q_keys[q], reps, tau)
            found[q] = NO_POOL if hit is None else hit
    return merged, found


def _first_fit(text: str, reps: list[tuple[int, SequenceMatcher]], tau: float) -> int | None:
    """The pool of the first representative with ratio(text, rep) >= τ. real_quick_ratio
    and quick_ratio bound ratio from above (the same 2M/T with more matches counted), so
    skipping on them changes no decision; b (the rep) is analysed once per matcher."""
    for pool, matcher in reps:
        matcher.set_seq1(text)
        bounds = matcher.real_quick_ratio() >= tau and matcher.quick_ratio() >= tau
        if bounds and matcher.ratio() >= tau:
            return pool
    return None


# --- minhash:τ (ours) -----------------------------------------------------------------


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective 64-bit mix (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _spans(start: np.ndarray, count: np.ndarray) -> np.ndarray:
    """start[i], start[i]+1, …, start[i]+count[i]−1 for every i, concatenated."""
    within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(count) - count, count
    )
    return np.repeat(start, count) + within


def _utf8(keys: pl.Series) -> tuple[np.ndarray, np.ndarray]:
    """The keys' UTF-8 bytes back to back, and their n + 1 offsets."""
    import pyarrow as pa

    arrow = keys.to_arrow(compat_level=pl.CompatLevel.oldest())
    if isinstance(arrow, pa.ChunkedArray):
        arrow = arrow.combine_chunks()
    arrow = arrow.cast(pa.large_string())
    _, offsets, data = arrow.buffers()
    offsets = np.frombuffer(offsets, np.int64)[arrow.offset : arrow.offset + len(arrow) + 1]
    data = np.zeros(0, np.uint8) if data is None else np.frombuffer(data, np.uint8)
    return data, offsets


def sketches(keys: pl.Series) -> np.ndarray:
    """[keys, BINS] uint32 one-permutation MinHash sketches: the shingles (every 4 bytes
    of the key's UTF-8; a key shorter than that is one shingle) are mixed, the top 6
    bits of the hash pick a bin and the bin keeps the least of the next 32 bits
    (_EMPTY where no shingle fell). Vectorised, in chunks of keys to bound memory."""
    return _sketch_bytes(*_utf8(keys))


def _sketch_bytes(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`sketches` of the keys whose UTF-8 bytes are data[offsets[i]:offsets[i + 1]]."""
    data, offsets = data[offsets[0] : offsets[-1]], offsets - offsets[0]
    m = int(offsets[-1]) if offsets.size else 0
    d = np.zeros(m + SHINGLE + 1, np.uint64)
    d[: data[:m].shape[0]] = data[:m]
    packed = np.zeros(m + 1, np.uint64)  # the 4 bytes starting at every byte
    for j in range(SHINGLE):
        packed |= d[j : j + m + 1] << np.uint64(8 * j)
    lengths = np.diff(offsets)
    counts = np.maximum(lengths - (SHINGLE - 1), 1)
    ends = np.cumsum(counts)
    out = np.full((lengths.shape[0], BINS), _EMPTY, np.uint32)
    flat = out.reshape(-1)
    start = 0
    while start < lengths.shape[0]:
        base = int(ends[start - 1]) if start else 0
        stop = max(int(np.searchsorted(ends, base + _CHUNK_BYTES, "right")), start + 1)
        owner = np.repeat(np.arange(start, stop), counts[start:stop])
        shingle = packed[_spans(offsets[start:stop], counts[start:stop])]
        length = lengths[owner]
        short = length < SHINGLE  # only the key's own bytes, and its length
        if short.any():
            n = length[short].astype(np.uint64)
            keep = (np.uint64(1) << (np.uint64(8) * n)) - np.uint64(1)
            shingle[short] = (shingle[short] & keep) | ((n + np.uint64(1)) << np.uint64(32))
        h = _mix(shingle ^ _MIX_SEED)
        bins = (h >> np.uint64(58)).astype(np.intp)
        value = (h & np.uint64(0xFFFFFFFE)).astype(np.uint32)  # never _EMPTY
        np.minimum.at(flat, owner * BINS + bins, value)
        start = stop
    return out


def band_rows(tau: float) -> int:
    """Sketch bins per LSH band: the largest power of 2 with which a pair at Jaccard τ
    still shares a band with probability >= RECALL_AT_TAU (16 bands of 4 at τ = 0.8)."""
    rows = 1
    while rows < BINS and 1 - (1 - tau ** (2 * rows)) ** (BINS // (2 * rows)) >= RECALL_AT_TAU:
        rows *= 2
    return rows


def similarity(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Estimated Jaccard of sketch rows a[i] and b[i]: equal non-empty bins over bins
    non-empty in either (one-permutation hashing, no densification)."""
    both = ((a == b) & (a != _EMPTY)).sum(axis=1)
    either = ((a != _EMPTY) | (b != _EMPTY)).sum(axis=1)
    return both / np.maximum(either, 1)


def _buckets(sketch: np.ndarray, gid: np.ndarray, rows: int) -> np.ndarray:
    """[keys, bands] uint64 LSH bucket of each band, salted by group and band; 0 for a
    band whose bins are all empty (never a candidate)."""
    bands = sketch.reshape(sketch.shape[0], BINS // rows, rows).astype(np.uint64)
    h = _mix(
        gid.astype(np.uint64)[:, None]
        ^ _mix(np.arange(bands.shape[1], dtype=np.uint64) + _MIX_SEED)[None, :]
    )
    for j in range(rows):
        h = _mix(h ^ bands[:, :, j])
    h[h == 0] = 1
    h[(bands == np.uint64(_EMPTY)).all(axis=2)] = 0
    return h


def _bucket_pairs(bucket: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidate links: each key with the least-ranked key of every (non-zero) bucket it
    shares, once. A star per bucket, not every pair: near-identical keys fill one bucket,
    and all pairs would be quadratic in it; the least key is fixed by string order, so
    the candidates do not depend on row order."""
    n, bands = bucket.shape
    flat = bucket.reshape(-1)
    item = np.repeat(np.arange(n, dtype=np.int64), bands)
    keep = flat != 0
    flat, item = flat[keep], item[keep]
    order = np.lexsort((rank[item], flat))
    flat, item = flat[order], item[order]
    head = np.concatenate(([True], flat[1:] != flat[:-1]))
    first = item[np.flatnonzero(head)][np.cumsum(head) - 1]  # the bucket's least key
    a, b = first[~head], item[~head]
    code = np.unique(np.minimum(a, b) * n + np.maximum(a, b))
    return code // n, code % n


def components(a: np.ndarray, b: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Connected components of the graph on len(rank) nodes with edges (a, b): each
    node's label is the node of least `rank` (distinct ints 0..n−1) in its component.
    Min-label propagation along the edges with pointer jumping, vectorised."""
    node = np.empty(rank.shape[0], np.int64)
    node[rank] = np.arange(rank.shape[0])
    label = rank.astype(np.int64).copy()
    while True:
        before = label.copy()
        least = np.minimum(label[a], label[b])
        np.minimum.at(label, a, least)
        np.minimum.at(label, b, least)
        while True:  # a label names a node of the same component with a smaller rank
            jumped = label[node[label]]
            if np.array_equal(jumped, label):
                break
            label = jumped
        if np.array_equal(label, before):
            return node[label]


def _minhash(
    key: pl.Series,
    key_gid: np.ndarray,
    tau: float,
    query_key: pl.Series,
    query_gid: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Each exact pool's component of LSH links (labelled by the pool of its smallest
    key), and the component of each query's most similar linked key (NO_POOL if none).

    Pools never cross groups, so the work runs over blocks of whole groups of about
    _BLOCK_KEYS keys: every array of a block stays in cache, and the result is the one a
    single pass would give (buckets, links and ranks are all within a group)."""
    n = key.len()
    by_string = (key.rank("dense") - 1).cast(pl.Int64).to_numpy()  # equal only across groups
    rank = np.empty(n, np.int64)
    rank[np.lexsort((key_gid, by_string))] = np.arange(n)
    rows = band_rows(tau)
    order = np.argsort(key_gid, kind="stable")
    q_order = np.argsort(query_gid, kind="stable")
    gids, q_gids = key_gid[order], query_gid[q_order]
    merged = np.arange(n, dtype=np.int64)
    found = np.full(query_gid.shape[0], NO_POOL, INDEX)
    group_start = np.flatnonzero(np.concatenate(([True], gids[1:] != gids[:-1])))
    at = np.searchsorted(group_start, np.arange(0, n, _BLOCK_KEYS), "right") - 1
    cuts = np.unique(group_start[at])  # each block starts where a group does
    text, q_text = _utf8(key.gather(order)), _utf8(query_key.gather(q_order))  # once
    for lo, hi in zip(cuts, [*cuts[1:], n], strict=True):
        idx = order[lo:hi]
        q_lo, q_hi = np.searchsorted(q_gids, [gids[lo], gids[hi - 1] + 1])
        q_idx = q_order[q_lo:q_hi]
        block, q_found = _minhash_block(
            (text[0], text[1][lo : hi + 1]), key_gid[idx], rank[idx], tau, rows,
            (q_text[0], q_text[1][q_lo : q_hi + 1]), query_gid[q_idx],
        )  # fmt: skip
        merged[idx] = idx[block]
        found[q_idx] = np.where(q_found == NO_POOL, NO_POOL, idx[np.maximum(q_found, 0)])
    return merged.astype(INDEX), found


def _minhash_block(
    key: tuple[np.ndarray, np.ndarray],
    key_gid: np.ndarray,
    rank: np.ndarray,
    tau: float,
    rows: int,
    query_key: tuple[np.ndarray, np.ndarray],
    query_gid: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """_minhash on whole groups (keys and queries as UTF-8 bytes and offsets), in local
    indices: each key's component label (its least ranked key) and each query's best
    linked key's label (NO_POOL if none)."""
    n = key_gid.shape[0]
    local = np.empty(n, np.int64)  # ranks 0..n−1 in the same order
    local[np.argsort(rank)] = np.arange(n)
    sketch = _sketch_bytes(*key)
    bucket = _buckets(sketch, key_gid, rows)
    a, b = _bucket_pairs(bucket, local)
    linked = (key_gid[a] == key_gid[b]) & (similarity(sketch[a], sketch[b]) >= tau)
    merged = components(a[linked], b[linked], local)
    found = np.full(query_gid.shape[0], NO_POOL, np.int64)
    if not query_gid.size:
        return merged, found
    # Queries: the keys sharing a bucket with them, once each, verified like a link.
    q_sketch = _sketch_bytes(*query_key)
    q_bucket = _buckets(q_sketch, query_gid, rows).reshape(-1)
    k_bucket = bucket.reshape(-1)
    by_bucket = np.argsort(k_bucket, kind="stable")
    k_bucket = k_bucket[by_bucket]
    k_item = by_bucket // bucket.shape[1]
    lo = np.searchsorted(k_bucket, q_bucket, "left")
    count = np.where(q_bucket == 0, 0, np.searchsorted(k_bucket, q_bucket, "right") - lo)
    qi = np.repeat(np.arange(q_bucket.shape[0]) // bucket.shape[1], count)
    ki = k_item[_spans(lo, count)]
    pair = np.unique(qi * n + ki)
    qi, ki = pair // n, pair % n
    score = similarity(q_sketch[qi], sketch[ki])
    ok = (key_gid[ki] == query_gid[qi]) & (score >= tau)
    qi, ki, score = qi[ok], ki[ok], score[ok]
    if qi.size:  # the best: highest score, then the component with the smallest key
        order = np.lexsort((local[merged[ki]], -score, qi))
        qi, ki = qi[order], ki[order]
        head = np.concatenate(([True], qi[1:] != qi[:-1]))
        found[qi[head]] = merged[ki[head]]
    return merged, found

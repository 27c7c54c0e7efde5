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
    their one-permutation MinHash sketches (64 bins over byte 4-gram shingles: each
    4-gram read as a little-endian uint32 and hashed by one 64-bit multiply-shift, the
    top 6 bits of the hash its bin, the bin keeping the least hash) share an LSH band
    bucket, one of them is that bucket's least key (string order: a star per bucket, not
    all pairs, which would be quadratic in a bucket of near-duplicates), and they
    estimate a Jaccard similarity ≥ τ; pools are the connected components of the links.
    Nothing depends on row order (the sketches and links depend only on the strings and
    their groups), so a shuffled batch gets the same pools. It runs on one key per exact
    pool, over blocks of whole groups of about 4096 keys (arrays that stay in cache);
    each bucket's least key comes from a scatter-min into a slot table, not a sort; the
    bands are taken in two phases, a phase verifying only the links whose ends are still
    in different components, and a group already one component skips the second (the
    same components: a link inside a component changes none).

A truncated end's `next_state_key` is mapped through the same grouping: its exact pool when
the group visited that key; otherwise, for `normalized` the pool of its canonical key, for
`similar` the first cluster whose representative it matches, for `minhash` the pool of
the most similar key (estimated Jaccard >= τ) among the keys of its group that share one
of its LSH buckets (ties: the component with the smallest key); NO_POOL when nothing
matches. Each pool is labelled (`Pools.label`, the SQL views' `pool_id`) by a
key: the state key (exact), the canonical key (normalized), the cluster's first member
(similar), the component's smallest key (minhash).
"""

from __future__ import annotations

import importlib
import math
import sys
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
_SHINGLE_A = np.uint64(0x9E3779B97F4A7C15)  # odd: the multiply-shift of the shingles
_BIN_SHIFT = np.uint32(32 - (BINS - 1).bit_length())  # a hash's top bits: its bin
_HIGH = int(sys.byteorder == "little")  # the high uint32 of a uint64, in a uint32 view
_SALT = np.uint64(0xD1B54A32D192ED03)
_BUCKET_A = np.uint64(0xBF58476D1CE4E5B9)
_CHUNK_BYTES = 1 << 18  # shingles hashed per pass: arrays that stay in cache
_BLOCK_KEYS = 4096  # minhash works over blocks of whole groups of about this many keys
_NO_KEY = np.int32(np.iinfo(np.int32).max)  # an unused slot of the bucket-head table
_TABLE_LOAD = 2  # the head table: 2 to 4 slots per (key, band) entry (few collisions)
_PHASES = (2,)  # LSH bands taken in each phase before the rest


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
    """splitmix64's finaliser: a bijective 64-bit mix (wrapping uint64 arithmetic). Only
    for salts (one per group or band), not per shingle."""
    x = x ^ (x >> np.uint64(30))
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


_BAND_SALT = _mix(np.arange(BINS, dtype=np.uint64) ^ np.uint64(0x8CB92BA72F3D8DD7))


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


def _shingle_hash(x: np.ndarray) -> np.ndarray:
    """Multiply-shift (Dietzfelbinger et al.): the high 32 bits of x·A mod 2^64 for an
    odd A, universal in its top bits (which pick the bin); x (uint64) is overwritten.
    Bit 0 is cleared, so no hash is _EMPTY. One multiply per shingle: the sketches'
    cost is in how many shingles there are, so the hash is the cheapest good one. The
    result is a contiguous uint32 array (the scatter reads it at full speed)."""
    x *= _SHINGLE_A
    x >>= np.uint64(32)
    high = x.astype(np.uint32)
    high &= np.uint32(0xFFFFFFFE)
    return high


def sketches(keys: pl.Series) -> np.ndarray:
    """[keys, BINS] uint32 one-permutation MinHash sketches: every 4 bytes of the key's
    UTF-8, read as a little-endian uint32 (a key shorter than that is one shingle: its
    bytes and its length), are hashed by multiply-shift; the top 6 bits of the hash
    pick a bin and the bin keeps the least hash (_EMPTY where no shingle fell)."""
    return _sketch_bytes(*_utf8(keys))


def _sketch_bytes(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`sketches` of the keys whose UTF-8 bytes are data[offsets[i]:offsets[i + 1]].

    The window at every byte is hashed (a strided uint32 view of the bytes) and scattered
    with one `np.minimum.at` into a flat (keys + 1) × BINS array: the 3 windows that run
    past each key's end go to the extra row, which is dropped. In chunks of whole keys of
    about _CHUNK_BYTES, so the arrays stay in cache."""
    data, offsets = data[offsets[0] : offsets[-1]], offsets - offsets[0]
    n, m = offsets.shape[0] - 1, int(offsets[-1])
    padded = np.zeros(m + SHINGLE, np.uint8)
    padded[:m] = data[:m]
    window = np.ndarray((m + 1,), "<u4", padded, 0, (1,))  # the 4 bytes from each byte on
    lengths = np.diff(offsets)
    whole = lengths >= SHINGLE
    kept = np.where(whole, lengths - (SHINGLE - 1), 0)  # windows inside the key
    runs = np.stack((kept, lengths - kept), axis=1).reshape(-1)
    out = np.full((n + 1, BINS), _EMPTY, np.uint32)
    flat = out.reshape(-1)
    start = 0
    while start < n:
        stop = int(np.searchsorted(offsets, offsets[start] + _CHUNK_BYTES, "right")) - 1
        stop = min(max(stop, start + 1), n)
        rows = np.stack((np.arange(start, stop) * BINS, np.full(stop - start, n * BINS)), 1)
        index = np.repeat(rows.reshape(-1).astype(np.intp), runs[2 * start : 2 * stop])
        h = _shingle_hash(window[offsets[start] : offsets[stop]].astype(np.uint64))
        index += h >> _BIN_SHIFT
        np.minimum.at(flat, index, h)
        start = stop
    short = np.flatnonzero(~whole)
    if short.size:  # one shingle each: the key's bytes, and its length above them
        length = lengths[short].astype(np.uint64)
        x = window[offsets[short]] & ((np.uint64(1) << (np.uint64(8) * length)) - np.uint64(1))
        h = _shingle_hash(x | ((length + np.uint64(1)) << np.uint64(32)))
        flat[short * BINS + (h >> _BIN_SHIFT)] = h
    return out[:n]


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


def _summary(sketch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What verification reads of a sketch: the sketch, its non-empty bins as the bits of
    one uint64, and one byte of every bin's hash (bits 8–15: a quarter of the memory)."""
    sketch = np.ascontiguousarray(sketch)
    bits = np.packbits(sketch != _EMPTY, axis=1, bitorder="little")
    filled = np.ascontiguousarray(bits).view(np.uint64)[:, 0]
    return sketch, filled, (sketch >> np.uint32(8)).astype(np.uint8)


def _rows(x: np.ndarray, i: np.ndarray) -> np.ndarray:
    """x[i] for a C-contiguous 2-D x, each row moved as one opaque item (several times
    faster than numpy's element-wise fancy indexing of rows)."""
    row = np.dtype((np.void, x.shape[1] * x.itemsize))
    return np.take(x.view(row).reshape(-1), i).view(x.dtype).reshape(i.shape[0], x.shape[1])


_BYTE_SUM = np.uint64(0x0101010101010101)


def _equal_bins(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, how many of the BINS columns of a and b are equal: the bool row viewed
    as 8 uint64s, added column by column (8 byte counters each), then a byte sum."""
    equal = (a == b).view(np.uint64)  # [pairs, BINS / 8], bytes 0 or 1
    total = equal[:, 0].copy()
    for j in range(1, equal.shape[1]):
        total += equal[:, j]
    total *= _BYTE_SUM
    total >>= np.uint64(56)
    return total.astype(np.int64)


def _bound(left: tuple, right: tuple, a: np.ndarray, b: np.ndarray):
    """For the pairs (left key a[i], right key b[i]) of two `_summary`s: an upper bound
    of similarity(...) (bins equal in both hashes have equal bytes, so equal bytes bound
    the equal bins), and what the exact score needs: the bins non-empty in either, and
    the bins empty in both (equal in every comparison)."""
    either = np.bitwise_count(left[1][a] | right[1][b]).astype(np.int64)
    either = np.maximum(either, 1)
    empty = BINS - either
    bound = _equal_bins(_rows(left[2], a), _rows(right[2], b)) - empty
    return bound / either, either, empty


def _score(left: tuple, right: tuple, a: np.ndarray, b: np.ndarray, either, empty):
    """similarity(...) of the pairs (left key a[i], right key b[i]), all bins compared."""
    return (_equal_bins(_rows(left[0], a), _rows(right[0], b)) - empty) / either


def _verify(left: tuple, right: tuple, a: np.ndarray, b: np.ndarray, tau: float):
    """The pairs (left key a[i], right key b[i]) whose similarity(...) >= τ, as indices
    into a and b, with their similarities. Pairs whose `_bound` is already below τ skip
    the full comparison, which changes no decision."""
    bound, either, empty = _bound(left, right, a, b)
    maybe = np.flatnonzero(bound >= tau)
    score = _score(left, right, a[maybe], b[maybe], either[maybe], empty[maybe])
    ok = score >= tau
    return maybe[ok], score[ok]


def _bucket_hashes(
    sketch: tuple[np.ndarray, np.ndarray, np.ndarray], gid: np.ndarray, rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """For a `_summary`: [keys, bands] uint64, each band's LSH bucket (a hash of the
    band's bins salted by group and band index, so buckets never cross either), and
    [keys, bands] bool, the bands whose bins are all empty (never a candidate)."""
    bins, filled = sketch[0], sketch[1]
    n, bands = bins.shape[0], BINS // rows
    if rows == 1:
        words = bins.astype(np.uint64)[:, :, None]
    else:  # two bins per uint64
        words = bins.view(np.uint64).reshape(n, bands, rows // 2)
    h = _mix(gid.astype(np.uint64) + _SALT)[:, None] ^ _BAND_SALT[None, :bands]
    for j in range(words.shape[2]):  # multiply-xorshift: a bijection of each word in turn
        h ^= words[:, :, j]
        h *= _BUCKET_A
        h ^= h >> np.uint64(29)
    shift = np.arange(0, BINS, rows, dtype=np.uint64)
    empty = (filled[:, None] >> shift) & np.uint64((1 << rows) - 1) == 0  # [keys, bands]
    return h, empty


def _heads(bucket: np.ndarray, empty: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[keys, bands] int32: the least key of each (key, band)'s bucket among the keys
    whose band is not empty (the key itself where it is). One np.minimum.at of the key
    indices into `table` (a power of 2 of _NO_KEY, and one more slot where the empty
    bands go) at each bucket's top bits gives each slot's least key; where that key is
    not in the entry's bucket (two buckets met in one slot), the bucket's keys are sorted
    instead. No sort of every entry; `table` is left as it was found."""
    n, bands = bucket.shape
    flat = bucket.reshape(-1)
    dead = empty.reshape(-1)
    slot = (flat >> np.uint64(65 - table.shape[0].bit_length())).astype(np.intp)
    slot[dead] = table.shape[0] - 1  # out of every bucket's way
    key = np.repeat(np.arange(n, dtype=np.int32), bands)
    np.minimum.at(table, slot, key)
    head = table[slot]
    table[slot] = _NO_KEY
    head[dead] = key[dead]
    own = head.astype(np.intp) * bands
    own += np.tile(np.arange(bands, dtype=np.intp), n)  # the head's entry in this band
    miss = np.flatnonzero(flat[own] != flat)  # never an empty band: its head is itself
    if miss.size:  # whole buckets (all their entries meet the same slot): sorted by bucket
        miss = miss[np.argsort(flat[miss], kind="stable")]  # keys ascending within one
        start = np.flatnonzero(_starts(flat[miss]))
        head[miss] = np.repeat(key[miss[start]], np.diff(start, append=miss.shape[0]))
    return head.reshape(n, bands)


def _starts(values: np.ndarray) -> np.ndarray:
    """Where each run of equal values in a sorted array starts."""
    start = np.ones(values.shape[0], bool)
    np.not_equal(values[1:], values[:-1], out=start[1:])
    return start


def components(a: np.ndarray, b: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Connected components of the graph on len(rank) nodes with edges (a, b): each
    node's label is the node of least `rank` (distinct ints 0..n−1) in its component
    (`_merge` of every edge, on the nodes renumbered by rank)."""
    node = np.empty(rank.shape[0], np.int64)
    node[rank] = np.arange(rank.shape[0])
    return node[_merge(np.arange(rank.shape[0]), rank[a], rank[b])[rank]]


def _merge(label: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Component labels (each node's least node) after adding edges (a, b) to a graph
    labelled `label`: each edge hooks the greater of its ends' labels onto the lesser,
    then labels jump to their labels' labels until fixed; repeated until no edge joins
    two labels. Works on the labels the edges touch, so a round costs its edges."""
    label = label.copy()
    while True:
        ra, rb = label[a], label[b]
        cross = ra != rb
        if not cross.any():
            return label
        a, b, ra, rb = a[cross], b[cross], ra[cross], rb[cross]
        least = np.minimum(ra, rb)
        np.minimum.at(label, ra, least)  # ra, rb are labels: label[ra] == ra before
        np.minimum.at(label, rb, least)
        while True:
            jumped = label[label]
            if np.array_equal(jumped, label):
                break
            label = jumped


def _minhash(
    key: pl.Series,
    key_gid: np.ndarray,
    tau: float,
    query_key: pl.Series,
    query_gid: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Each exact pool's component of LSH links (labelled by the pool of its smallest
    key), and the component of each query's most similar key among those of its group
    that share one of its buckets (NO_POOL if none reaches τ).

    The keys are put in (group, string) order once; pools never cross groups, so the
    work runs over blocks of whole groups of about _BLOCK_KEYS keys: every array of a
    block stays in cache, and the result is the one a single pass would give (buckets,
    links and order are all within a group)."""
    n = key.len()
    frame = pl.DataFrame({"g": key_gid, "k": key}).with_row_index("i")
    if n < 2 or (key_gid[1:] >= key_gid[:-1]).all():  # exact pools come group by group:
        sort = pl.col("i").sort_by("k").over("g")  # sort within each group (half the time)
    else:
        sort = pl.arg_sort_by("g", "k")
    order = frame.select(sort).to_series().to_numpy().astype(np.int64)
    rows = band_rows(tau)
    q_order = np.argsort(query_gid, kind="stable")
    gids, q_gids = key_gid[order], query_gid[q_order]
    merged = np.arange(n, dtype=np.int64)
    found = np.full(query_gid.shape[0], NO_POOL, INDEX)
    group_start = np.flatnonzero(np.concatenate(([True], gids[1:] != gids[:-1])))
    at = np.searchsorted(group_start, np.arange(0, n, _BLOCK_KEYS), "right") - 1
    cuts = np.unique(group_start[at])  # each block starts where a group does
    text, q_text = _utf8(key.gather(order)), _utf8(query_key.gather(q_order))  # once
    tables: dict[int, np.ndarray] = {}  # the bucket-head tables, reused by every block
    for lo, hi in zip(cuts, [*cuts[1:], n], strict=True):
        idx = order[lo:hi]
        q_lo, q_hi = np.searchsorted(q_gids, [gids[lo], gids[hi - 1] + 1])
        q_idx = q_order[q_lo:q_hi]
        size = max(_TABLE_LOAD * int(hi - lo) * (BINS // rows), 1 << 10).bit_length()
        if size not in tables:
            tables[size] = np.full((1 << size) + 1, _NO_KEY, np.int32)
        block, q_found = _minhash_block(
            (text[0], text[1][lo : hi + 1]), gids[lo:hi], tau, rows,
            (q_text[0], q_text[1][q_lo : q_hi + 1]), q_gids[q_lo:q_hi], tables[size],
        )  # fmt: skip
        merged[idx] = idx[block]
        found[q_idx] = np.where(q_found == NO_POOL, NO_POOL, idx[np.maximum(q_found, 0)])
    return merged.astype(INDEX), found


def _minhash_block(
    key: tuple[np.ndarray, np.ndarray],
    key_gid: np.ndarray,
    tau: float,
    rows: int,
    query_key: tuple[np.ndarray, np.ndarray],
    query_gid: np.ndarray,
    table: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """_minhash on whole groups whose keys (UTF-8 bytes and offsets) come in (group,
    string) order, in local indices: each key's component label (its first key in that
    order) and each query's best linked key's label (NO_POOL if none).

    Each key's candidate links are the distinct heads of its buckets. The bands are taken
    in phases (_PHASES bands, then the rest), and a phase verifies only the candidates
    whose ends are still in different components: a link inside a component changes no
    component, so the components are those of every verified link. A group that is
    already one component leaves the later phases (at low τ, most groups after the first
    band or two): buckets never cross groups, so the other groups' heads do not change."""
    n = key_gid.shape[0]
    keys = _summary(_sketch_bytes(*key))
    bucket, empty = _bucket_hashes(keys, key_gid, rows)
    bands = bucket.shape[1]
    group_start = np.flatnonzero(_starts(key_gid))
    group_size = np.diff(group_start, append=n)
    label = np.arange(n)
    active = label  # the keys of groups that are not one component yet
    done = 0
    for width in (*_PHASES, bands):
        span = slice(done, min(done + width, bands))
        done = span.stop
        head = _heads(bucket[active, span], empty[active, span], table)
        head.sort(axis=1)
        fresh = np.ones(head.shape, bool)  # a distinct head other than the key itself
        np.not_equal(head[:, 1:], head[:, :-1], out=fresh[:, 1:])
        fresh &= head != np.arange(active.shape[0])[:, None]
        head = active[head]  # local to the block again
        fresh &= label[head] != label[active][:, None]
        member, j = np.nonzero(fresh)
        if member.size:
            other, member = head[member, j], active[member]
            ok = _verify(keys, keys, other, member, tau)[0]
            ok = ok[key_gid[other[ok]] == key_gid[member[ok]]]
            label = _merge(label, other[ok], member[ok])
        if done >= bands:
            break
        roots = np.add.reduceat((label == np.arange(n)).view(np.uint8), group_start)
        if (roots == 1).all():
            break
        active = np.flatnonzero(np.repeat(roots > 1, group_size))
    found = np.full(query_gid.shape[0], NO_POOL, np.int64)
    if not query_gid.size:
        return label, found
    # Queries: compared with every key of their group that shares one of their buckets
    # (as one more key of the group would be, without joining it); the best gives the
    # pool. The cheap bound goes first, the bucket check last; a query's exact scores are
    # needed only where the bound reaches the score of its pair of highest bound, when
    # that pair shares a bucket (no pair below it can be the best).
    queries = _summary(_sketch_bytes(*query_key))
    q_bucket, _ = _bucket_hashes(queries, query_gid, rows)
    lo = np.searchsorted(key_gid, query_gid, "left")
    hi = np.searchsorted(key_gid, query_gid, "right")
    qi = np.repeat(np.arange(query_gid.shape[0]), hi - lo)  # every (query, key of its group)
    ki = np.arange(qi.shape[0]) - np.repeat(np.cumsum(hi - lo) - hi, hi - lo)

    def shared(q: np.ndarray, k: np.ndarray) -> np.ndarray:
        return ((_rows(bucket, k) == _rows(q_bucket, q)) & ~_rows(empty, k)).any(axis=1)

    bound, either, both_empty = _bound(queries, keys, qi, ki)
    keep = np.flatnonzero(bound >= tau)
    qi, ki, bound = qi[keep], ki[keep], bound[keep]
    either, both_empty = either[keep], both_empty[keep]
    if not qi.size:
        return label, found
    start = np.flatnonzero(_starts(qi))  # qi ascends: each query's pairs are one run
    highest = np.repeat(np.maximum.reduceat(bound, start), np.diff(start, append=qi.shape[0]))
    top = np.flatnonzero(bound == highest)
    top = top[_starts(qi[top])]  # each query's first pair of highest bound
    top = top[shared(qi[top], ki[top])]
    floor = np.zeros(query_gid.shape[0])
    floor[qi[top]] = _score(queries, keys, qi[top], ki[top], either[top], both_empty[top])
    keep = np.flatnonzero(bound >= np.maximum(floor[qi], tau))
    qi, ki = qi[keep], ki[keep]
    score = _score(queries, keys, qi, ki, either[keep], both_empty[keep])
    ok = np.flatnonzero(score >= tau)
    ok = ok[shared(qi[ok], ki[ok])]
    qi, ki, score = qi[ok], ki[ok], score[ok]
    if qi.size:  # the best: highest score, then the component with the smallest key
        best = np.lexsort((label[ki], -score, qi))
        qi, ki = qi[best], ki[best]
        first = _starts(qi)
        found[qi[first]] = label[ki[first]]
    return label, found

"""minhash:τ, grouping.py's order-independent similarity mode, on numba kernels.

    minhash_pools(key, key_gid, tau, query_key, query_gid) -> (merged, found)

`key` holds one key per exact pool. Two distinct keys of a group are linked when

  * their one-permutation MinHash sketches share an LSH band bucket: 64 bins over the
    key's byte 4-grams, each 4-gram read as a little-endian uint32 and hashed by one
    64-bit multiply-shift (the high 32 bits of x·A, bit 0 cleared), the hash's top 6
    bits its bin, the bin keeping the least hash; bands of `band_rows(τ)` bins;
  * one of them is that bucket's *head*, the key of least fingerprint (the 64-bit
    FNV-1a hash of its UTF-8 bytes): a star per bucket, not all pairs, which would be
    quadratic in a bucket of near-duplicates;
  * their sketches estimate a Jaccard similarity >= τ (`similarity`).

Pools are the connected components of the links. A query (a truncated end's next key
that its group never visited verbatim) takes the component of its most similar key among
those of its group that share one of its buckets (estimate >= τ; ties to the component
whose least-fingerprint key has the least fingerprint), or NO_POOL.

Nothing depends on row order: sketches, fingerprints and links depend only on the strings
and their groups (the distinct keys of a group have distinct fingerprints but for a 2^-64
collision, where the lesser index breaks the tie). `merged[k]` is the key of least
fingerprint in k's component, `found[q]` that of q's component; grouping.py labels each
pool by its smallest key in string order.

The work runs over blocks of whole groups of about _BLOCK_KEYS keys on as many threads as
Polars uses (the kernels release the GIL; each block writes only its own keys and
queries). Per group and band, the heads come from an open-addressing table; a link is
verified only when a union-find has its ends in different components (a link inside one
changes none), and a group that is already one component skips its remaining bands.
numba compiles the kernels on first use (a few seconds, cached on disk per machine);
grouping.py imports this module only for this mode.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import polars as pl

from gagpo.pipeline.grouping import utf8_buffers
from gagpo.pipeline.pools import NO_POOL
from gagpo.pipeline.scan import INDEX

SHINGLE = 4  # bytes per shingle
BINS = 64  # sketch bins
RECALL_AT_TAU = 0.999  # LSH recall asked for a pair exactly at τ (see band_rows)
EMPTY = np.uint32(0xFFFFFFFF)  # an empty sketch bin
_SHINGLE_A = np.uint64(0x9E3779B97F4A7C15)  # odd: the multiply-shift of the shingles
_BIN_SHIFT = np.uint64(32 - (BINS - 1).bit_length())  # a hash's top bits: its bin
_BUCKET_A = np.uint64(0xBF58476D1CE4E5B9)
_BUCKET_SEED = np.uint64(0xD1B54A32D192ED03)
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_BLOCK_KEYS = 4096  # keys per block of whole groups: arrays that stay in cache

_jit = numba.njit(cache=True, nogil=True)
_inline = numba.njit(cache=True, inline="always")  # small helpers, inlined where used


# --- the kernels -----------------------------------------------------------------------


@_jit
def _sketch_kernel(data, offsets, out, fingerprint):  # pragma: no cover (compiled)
    """out[i]: the sketch of the key data[offsets[i]:offsets[i + 1]] (one pass over its
    bytes, the 4-byte window rolled, hashed and kept per bin); fingerprint[i]: its FNV-1a.
    A key shorter than 4 bytes is one shingle: its bytes, and its length + 1 above them."""
    a, bits, odd, eight = _SHINGLE_A, np.uint64(32), np.uint64(0xFFFFFFFE), np.uint64(8)
    for i in range(offsets.shape[0] - 1):
        row = out[i]
        row[:] = EMPTY
        lo, hi = offsets[i], offsets[i + 1]
        fp = _FNV_OFFSET
        x = np.uint64(0)
        if hi - lo < SHINGLE:
            for p in range(hi - lo):
                byte = np.uint64(data[lo + p])
                fp = (fp ^ byte) * _FNV_PRIME
                x |= byte << (eight * np.uint64(p))
            x |= np.uint64(hi - lo + 1) << bits
            h = ((x * a) >> bits) & odd
            row[h >> _BIN_SHIFT] = h
            fingerprint[i] = fp
            continue
        for p in range(lo, lo + SHINGLE - 1):
            byte = np.uint64(data[p])
            fp = (fp ^ byte) * _FNV_PRIME
            x = (x >> eight) | (byte << np.uint64(24))
        for p in range(lo + SHINGLE - 1, hi):  # the window ending at byte p
            byte = np.uint64(data[p])
            fp = (fp ^ byte) * _FNV_PRIME
            x = (x >> eight) | (byte << np.uint64(24))
            h = ((x * a) >> bits) & odd
            b = h >> _BIN_SHIFT
            row[b] = min(row[b], h)  # branch-free: which shingle is least is unpredictable
        fingerprint[i] = fp


@_jit
def _bucket_kernel(words, none, bucket, empty):  # pragma: no cover (compiled)
    """bucket[j, i]: the words of key i's band j (its bins as uint64 words: one bin, or
    two with the low bin first) hashed in turn by multiply-xorshift; empty[j, i]: every
    word is `none` (all the band's bins are empty: the band is no candidate). Band-major,
    as the link kernel reads them."""
    a, shift = _BUCKET_A, np.uint64(29)
    bands = bucket.shape[0]
    per = words.shape[1] // bands
    for i in range(words.shape[0]):
        for j in range(bands):
            h = _BUCKET_SEED
            dead = True
            for w in range(j * per, j * per + per):
                word = words[i, w]
                dead &= word == none
                h ^= word
                h *= a
                h ^= h >> shift
            bucket[j, i] = h
            empty[j, i] = dead


@_inline
def _score(x, i, y, j):  # pragma: no cover (compiled)
    """similarity(x[i], y[j]): equal non-empty bins over bins non-empty in either."""
    both, either = 0, 0
    for t in range(BINS):  # branch-free: vectorised, faster than an early exit
        u, v = x[i, t], y[j, t]
        either += np.int64((u & v) != EMPTY)  # not empty in both
        both += np.int64((u == v) & (u != EMPTY))
    return both / max(either, 1)


@_inline
def _before(fingerprint, a, b):  # pragma: no cover (compiled)
    """Key a comes before key b: lesser fingerprint, then lesser index (equal sketches)."""
    return fingerprint[a] < fingerprint[b] or (fingerprint[a] == fingerprint[b] and a < b)


@_inline
def _root(label, k):  # pragma: no cover (compiled)
    while label[k] != k:
        label[k] = label[label[k]]  # path halving: a parent always comes before its child
        k = label[k]
    return k


@_jit
def _link_kernel(sketch, fingerprint, bucket, empty, group_start, tau, label):  # pragma: no cover
    """label[k]: the key of least fingerprint in k's component of links (module doc)."""
    bands, n = bucket.shape
    for k in range(n):
        label[k] = k
    widest = 1
    for g in range(group_start.shape[0] - 1):
        widest = max(widest, group_start[g + 1] - group_start[g])
    size = 2
    while size < 2 * widest:
        size *= 2
    table = np.zeros(size, np.int64)  # a bucket's head
    stamp = np.zeros(size, np.int64)  # the (group, band) turn that filled each slot
    slot_of = np.empty(widest, np.int64)
    head = np.empty((bands, widest), np.int64)  # each key's head per band (itself if none)
    turn = 0
    for g in range(group_start.shape[0] - 1):
        lo, hi = group_start[g], group_start[g + 1]
        if hi - lo < 2:
            continue
        width = 1
        while (1 << width) < 2 * (hi - lo):
            width += 1
        mask, top = (1 << width) - 1, np.uint64(64 - width)
        parts = hi - lo  # the group's components
        for j in range(bands):
            turn += 1
            band, dead, heads = bucket[j], empty[j], head[j]
            for k in range(lo, hi):  # each bucket's head: its key that comes first
                if dead[k]:
                    slot_of[k - lo] = -1
                    continue
                b = band[k]
                slot = np.int64(b >> top)
                while stamp[slot] == turn and band[table[slot]] != b:
                    slot = (slot + 1) & mask
                slot_of[k - lo] = slot
                if stamp[slot] != turn:
                    stamp[slot] = turn
                    table[slot] = k
                elif _before(fingerprint, k, table[slot]):
                    table[slot] = k
            for k in range(lo, hi):
                h = k if slot_of[k - lo] < 0 else table[slot_of[k - lo]]
                heads[k - lo] = h
                if h == k:  # the bucket's head, or an empty band
                    continue
                rh, rk = _root(label, h), _root(label, k)
                if rh == rk:  # a link that changes no component
                    continue
                seen = False  # the pair, verified already in an earlier band
                for i in range(j):
                    seen = seen or head[i, k - lo] == h
                if not seen and _score(sketch, h, sketch, k) >= tau:
                    if _before(fingerprint, rh, rk):
                        label[rk] = rh
                    else:
                        label[rh] = rk
                    parts -= 1
            if parts == 1:  # one component: no later band can change it
                break
    for k in range(n):
        label[k] = _root(label, k)


@_jit
def _query_kernel(
    sketch, fingerprint, bucket, empty, label, q_sketch, q_bucket, q_lo, q_hi, tau, found
):  # pragma: no cover (compiled)
    """found[q]: the label of query q's best key among keys q_lo[q]..q_hi[q] (its group)
    that share one of its buckets: highest similarity >= τ, then the label that comes
    first; NO_POOL if none."""
    bands = bucket.shape[0]
    for q in range(found.shape[0]):
        best, best_label = -1.0, -1
        for k in range(q_lo[q], q_hi[q]):
            shared = False
            for j in range(bands):
                if not empty[j, k] and bucket[j, k] == q_bucket[j, q]:
                    shared = True
                    break
            if not shared:
                continue
            s = _score(q_sketch, q, sketch, k)
            if s < tau or s < best:
                continue
            if s > best or _before(fingerprint, label[k], best_label):
                best, best_label = s, label[k]
        found[q] = NO_POOL if best_label < 0 else best_label


# --- the pieces, as numpy ----------------------------------------------------------------


def band_rows(tau: float) -> int:
    """Sketch bins per LSH band: the largest power of 2 with which a pair at Jaccard τ
    still shares a band with probability >= RECALL_AT_TAU (16 bands of 4 at τ = 0.8)."""
    rows = 1
    while rows < BINS and 1 - (1 - tau ** (2 * rows)) ** (BINS // (2 * rows)) >= RECALL_AT_TAU:
        rows *= 2
    return rows


def sketch_bytes(data: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[keys, BINS] uint32 sketches and uint64 fingerprints of the keys whose UTF-8 bytes
    are data[offsets[i]:offsets[i + 1]]."""
    n = offsets.shape[0] - 1
    out, fingerprint = np.empty((n, BINS), np.uint32), np.empty(n, np.uint64)
    _sketch_kernel(data, np.ascontiguousarray(offsets, np.int64), out, fingerprint)
    return out, fingerprint


def sketches(keys: pl.Series) -> np.ndarray:
    """[keys, BINS] uint32 one-permutation MinHash sketches (module doc); EMPTY where no
    shingle fell in a bin."""
    return sketch_bytes(*utf8_buffers(keys))[0]


def fingerprints(keys: pl.Series) -> np.ndarray:
    """The keys' 64-bit FNV-1a hashes of their UTF-8 bytes (what orders bucket heads)."""
    return sketch_bytes(*utf8_buffers(keys))[1]


def bucket_hashes(sketch: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """[bands, keys] uint64 LSH buckets of sketch rows, and [bands, keys] bool: the bands
    whose bins are all empty (never a candidate). Buckets are compared within one group
    and band only, so they carry no salt of either."""
    n, bands = sketch.shape[0], BINS // rows
    bucket, empty = np.empty((bands, n), np.uint64), np.empty((bands, n), bool)
    sketch = np.ascontiguousarray(sketch)
    if rows == 1:
        words, none = sketch.astype(np.uint64), np.uint64(EMPTY)
    else:  # two bins per word
        words, none = sketch.view(np.uint64), ~np.uint64(0)
    _bucket_kernel(words, none, bucket, empty)
    return bucket, empty


def similarity(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Estimated Jaccard of sketch rows a[i] and b[i]: equal non-empty bins over bins
    non-empty in either (one-permutation hashing, no densification)."""
    both = ((a == b) & (a != EMPTY)).sum(axis=1)
    either = ((a != EMPTY) | (b != EMPTY)).sum(axis=1)
    return both / np.maximum(either, 1)


# --- the driver --------------------------------------------------------------------------


def minhash_pools(
    key: pl.Series,
    key_gid: np.ndarray,
    tau: float,
    query_key: pl.Series,
    query_gid: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Each key's component, as the index of its key of least fingerprint, and each
    query's component likewise (NO_POOL if none): see the module doc."""
    n = key.len()
    order = None  # exact pools come group by group: the keys are already in group order
    if n > 1 and not (key_gid[1:] >= key_gid[:-1]).all():
        order = np.argsort(key_gid, kind="stable")
    gids = key_gid if order is None else key_gid[order]
    q_order = np.argsort(query_gid, kind="stable")
    q_gids = query_gid[q_order]
    text = utf8_buffers(key if order is None else key.gather(order))
    q_text = utf8_buffers(query_key.gather(q_order))
    merged = np.arange(n, dtype=np.int64)
    found = np.full(query_gid.shape[0], NO_POOL, INDEX)
    if n == 0:
        return merged.astype(INDEX), found
    group_start = np.flatnonzero(np.concatenate(([True], gids[1:] != gids[:-1])))
    at = np.searchsorted(group_start, np.arange(0, n, _BLOCK_KEYS), "right") - 1
    cuts = np.unique(group_start[at])  # each block starts where a group does
    rows = band_rows(tau)

    def block(lo: int, hi: int) -> None:  # writes only its own groups' keys and queries
        idx = np.arange(lo, hi) if order is None else order[lo:hi]
        q_lo, q_hi = np.searchsorted(q_gids, [gids[lo], gids[hi - 1] + 1])
        label, q_found = _block(
            (text[0], text[1][lo : hi + 1]),
            gids[lo:hi],
            tau,
            rows,
            (q_text[0], q_text[1][q_lo : q_hi + 1]),
            q_gids[q_lo:q_hi],
        )
        merged[idx] = idx[label]
        q_idx = q_order[q_lo:q_hi]
        found[q_idx] = np.where(q_found == NO_POOL, NO_POOL, idx[np.maximum(q_found, 0)])

    # as many threads as Polars' pool (POLARS_MAX_THREADS caps both)
    with ThreadPoolExecutor(min(pl.thread_pool_size(), len(cuts))) as pool:
        list(pool.map(block, cuts, [*cuts[1:], n]))
    return merged.astype(INDEX), found


def _block(
    key: tuple[np.ndarray, np.ndarray],
    key_gid: np.ndarray,
    tau: float,
    rows: int,
    query_key: tuple[np.ndarray, np.ndarray],
    query_gid: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """minhash_pools on whole groups whose keys come group by group, in local indices."""
    n = key_gid.shape[0]
    sketch, fingerprint = sketch_bytes(*key)
    bucket, empty = bucket_hashes(sketch, rows)
    group_start = np.append(
        np.flatnonzero(np.concatenate(([True], key_gid[1:] != key_gid[:-1]))), n
    )
    label = np.empty(n, np.int64)
    _link_kernel(sketch, fingerprint, bucket, empty, group_start, float(tau), label)
    found = np.full(query_gid.shape[0], NO_POOL, np.int64)
    if query_gid.shape[0]:
        q_sketch, _ = sketch_bytes(*query_key)
        q_bucket, _ = bucket_hashes(q_sketch, rows)
        q_lo = np.searchsorted(key_gid, query_gid, "left").astype(np.int64)
        q_hi = np.searchsorted(key_gid, query_gid, "right").astype(np.int64)
        _query_kernel(
            sketch,
            fingerprint,
            bucket,
            empty,
            label,
            q_sketch,
            q_bucket,
            q_lo,
            q_hi,
            float(tau),
            found,
        )
    return label, found

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
    one space, and strips the ends (`canonical_keys`, Polars regexes; run as one compiled
    pass over the bytes of one key per exact pool, pipeline/canonical.py, equal string
    for string). `normalized:pkg.mod:fn` uses `fn(str) -> str` instead, called once per
    distinct key (user Python).
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
    ours, order-independent and compiled (pipeline/minhash.py, numba kernels): two
    distinct keys of a group are linked when their one-permutation MinHash sketches
    (64 bins over byte 4-gram shingles: each 4-gram read as a little-endian uint32 and
    hashed by one 64-bit multiply-shift, the top 6 bits of the hash its bin, the bin
    keeping the least hash) share an LSH band bucket, one of them is that bucket's head
    (its key of least fingerprint, the 64-bit FNV-1a of the key's bytes: a star per
    bucket, not all pairs, which would be quadratic in a bucket of near-duplicates), and
    they estimate a Jaccard similarity ≥ τ; pools are the connected components of the
    links. Nothing depends on row order (the sketches, fingerprints and links depend
    only on the strings and their groups), so a shuffled batch gets the same pools. It
    runs on one key per exact pool, over blocks of whole groups on Polars' thread count; a
    link is verified only across components of a union-find, and a group already one
    component skips its remaining bands (the same components).

A truncated end's `next_state_key` is mapped through the same grouping: its exact pool when
the group visited that key; otherwise, for `normalized` the pool of its canonical key, for
`similar` the first cluster whose representative it matches, for `minhash` the pool of
the most similar key (estimated Jaccard >= τ) among the keys of its group that share one
of its LSH buckets (ties: the component whose least-fingerprint key has the least
fingerprint); NO_POOL when nothing matches. Each pool is labelled (`Pools.label`, the SQL
views' `pool_id`) by a key: the state key (exact), the canonical key (normalized), the
cluster's first member (similar), the component's smallest key in string order (minhash).
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
from gagpo.schemas.loader import load_object

MODES = ("exact", "normalized", "similar", "minhash")
MODES_HELP = (
    "exact, normalized, normalized:MODULE:FUNCTION, similar:TAU, minhash:TAU (0 < TAU <= 1)"
)

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


class KeyFunctionError(GagpoError):
    """A user's key function failed, or returned something other than a string. Its message
    is one line; Polars appends the plan's expression to an error raised inside it."""

    def __str__(self) -> str:
        text = super().__str__()
        return text.splitlines()[0] if text else text


def load_function(spec: str) -> Callable[[str], str]:
    """The user's canonical-key function `module:function`, as one error line if missing,
    or if its module fails to import (a syntax error, an exception, sys.exit)."""
    return load_object(spec, f"state_grouping normalized:{spec}", "normalized:MODULE:FUNCTION")


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
    """Rows and queries through `merged` (exact pool → the representative exact pool of
    its merged pool, which is its own representative), with dense ids again, in the order
    of the representatives; each exact pool's new id; and each new id's representative."""
    is_rep = merged == np.arange(merged.shape[0])
    dense = (np.cumsum(is_rep, dtype=np.int64) - 1)[merged].astype(INDEX)
    query = np.where(query_pool == NO_POOL, NO_POOL, dense[np.maximum(query_pool, 0)])
    return dense[pool], query.astype(INDEX), dense, np.flatnonzero(is_rep)


def _least_keys(new_pool: np.ndarray, key: pl.Series) -> np.ndarray:
    """Per new pool id (dense), the index of its smallest key in string order."""
    frame = pl.DataFrame({"p": new_pool, "k": key}).with_row_index("i")
    least = frame.group_by("p").agg(pl.col("i").sort_by("k").first()).sort("p")
    return least["i"].to_numpy()


def group_states(
    grouping: Grouping,
    gid: np.ndarray,
    state_key: pl.Series,
    query_gid: np.ndarray,
    query_key: pl.Series,
    group_id: pl.Series | None = None,
) -> Pools:
    """The pools of every row's (group, state_key) and of every query under `grouping`;
    `group_id` (each row's, beside `gid`) names the group a user's key function failed on.

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
        name = _group_namer(gid, group_id)
        merged, found, key = _normalized(key, key_gid, grouping.function, *queries, name)
    elif grouping.mode == "similar":
        merged, found = _similar(key, key_gid, first, grouping.threshold, *queries)
    else:
        pools = _compiled("minhash").minhash_pools
        merged, found = pools(key, key_gid, grouping.threshold, *queries)
    query_pool = query_pool.copy()
    query_pool[missing] = found
    pool, query_pool, new_pool, reps = _relabel(merged, pool, query_pool)
    if grouping.mode == "minhash":  # labelled by its smallest key, not its representative
        return Pools(pool, query_pool, key, lambda: _least_keys(new_pool, key))
    return Pools(pool, query_pool, key, lambda: reps)


# --- normalized ------------------------------------------------------------------------


def _normalized(
    key: pl.Series,
    key_gid: np.ndarray,
    function: str | None,
    query_key: pl.Series,
    query_gid: np.ndarray,
    group_name: Callable[[int], str] = str,
) -> tuple[np.ndarray, np.ndarray, pl.Series]:
    """Each exact pool's merged pool (equal canonical keys in a group), the pool of each
    query's canonical key (NO_POOL if none), and the canonical key of each exact pool."""
    if function is None:
        fast = _compiled("canonical").canonical_keys_fast
        canon, q_canon = fast(key), fast(query_key)
    else:
        fn = _checked(
            function, load_function(function), key, key_gid, query_key, query_gid, group_name
        )
        canon, q_canon = _map_distinct(key, fn, query_key)
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


def _checked(
    spec: str,
    fn: Callable,
    key: pl.Series,
    key_gid: np.ndarray,
    query_key: pl.Series,
    query_gid: np.ndarray,
    group_name: Callable[[int], str],
) -> Callable[[str], str]:
    """`fn` as user input: an exception it raises (sys.exit included) or a result that is
    not a string becomes one line naming the function, the error and the group and key it
    failed on."""

    def where(text: str) -> str:
        hits = np.flatnonzero((key == text).fill_null(False).to_numpy())
        g = (
            key_gid[hits[0]]
            if hits.size
            else query_gid[np.flatnonzero((query_key == text).fill_null(False).to_numpy())[0]]
        )
        shown = text if len(text) <= 60 else text[:57] + "..."
        return f"on group {group_name(int(g))!r} (state_key {shown!r})"

    def call(text: str) -> str:
        try:
            out = fn(text)
        except (Exception, SystemExit) as exc:
            raise KeyFunctionError(
                f"state_grouping normalized:{spec} failed {where(text)}: {_error_line(exc)}; "
                "accepted: a function of one str that returns a str"
            ) from None
        if not isinstance(out, str):
            raise KeyFunctionError(
                f"state_grouping normalized:{spec} returned {type(out).__name__} "
                f"{_short(out)} {where(text)}; accepted: a function of one str that returns a str"
            )
        return out

    return call


def _error_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _group_namer(gid: np.ndarray, group_id: pl.Series | None) -> Callable[[int], str]:
    """The group_id of a dense group id (computed on a failure only)."""
    if group_id is None:
        return lambda g: f"#{g}"
    return lambda g: str(group_id[int(np.flatnonzero(gid == g)[0])])


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


# --- the compiled modes (pipeline/canonical.py, pipeline/minhash.py) ---------------


def utf8_buffers(keys: pl.Series) -> tuple[np.ndarray, np.ndarray]:
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


def _compiled(name: str):
    """pipeline/<name>.py, whose kernels numba compiles: imported only by the modes that
    need it (numba's import costs most of a second), as one error line without numba."""
    try:
        return importlib.import_module(f"gagpo.pipeline.{name}")
    except ImportError as exc:
        if exc.name not in ("numba", "llvmlite"):
            raise
        raise GagpoError(
            "state_grouping normalized and minhash need numba (a dependency of gagpo), "
            "which is not installed: pip install 'numba>=0.60'"
        ) from None

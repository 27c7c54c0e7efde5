"""The NumPy kernels of the advantage stage: exact scans and hashed state pools."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from gagpo.pipeline import pools
from gagpo.pipeline.scan import discounted_sum, level_layout, next_in_rollout


def shuffled_rollouts(lengths, seed=0):
    """(tid, step) of rollouts with the given lengths, rows in random order."""
    rng = np.random.default_rng(seed)
    tid = np.repeat(np.arange(len(lengths)), lengths)
    step = np.concatenate([np.arange(n) for n in lengths])
    order = rng.permutation(tid.shape[0])
    return tid[order], step[order]


def backward_loop(values, tid, step, c):
    """The textbook loop x_t = v_t + c·x_{t+1}, rollout by rollout."""
    out = np.empty_like(values)
    for t in np.unique(tid):
        rows = np.flatnonzero(tid == t)
        rows = rows[np.argsort(step[rows])]
        acc = 0.0
        for i in rows[::-1]:
            acc = values[i] + c * acc
            out[i] = acc
    return out


@pytest.mark.parametrize("c", [0.0, 1e-3, 0.0095, 0.5, 0.95 * 0.8, 1.0])
def test_discounted_sum_is_bit_identical_to_the_loop(c):
    lengths = [1, 2, 7, 5000, 3, 5000, 40]
    tid, step = shuffled_rollouts(lengths)
    pos, rem, valid = level_layout(tid, step)
    assert valid
    values = np.random.default_rng(1).standard_normal(tid.shape[0])
    got = discounted_sum(values, pos, rem, c)
    assert np.array_equal(got, backward_loop(values, tid, step, c))


def test_long_rollout_with_tiny_discount_does_not_underflow():
    """Power scaling (c^t·cumsum(v/c^t)) breaks here: c^t underflows after ~150 steps."""
    n = 6000
    tid, step = np.zeros(n, np.int64), np.arange(n)
    pos, rem, _ = level_layout(tid, step)
    values = np.ones(n)
    got = discounted_sum(values, pos, rem, 0.01)
    # Far from the end the sum is the geometric series 1/(1−c); the last step is 1.
    assert np.abs(got[:-10] - 1 / (1 - 0.01)).max() < 1e-12
    assert got[-1] == 1.0
    assert np.isfinite(got).all()


def test_next_in_rollout():
    tid, step = shuffled_rollouts([3, 1, 2], seed=3)
    pos, rem, _ = level_layout(tid, step)
    values = tid * 10.0 + step
    got = next_in_rollout(values, pos, rem, fill=-1.0)
    expected = np.where(rem > 0, values + 1, -1.0)
    assert np.array_equal(got, expected)


@pytest.mark.parametrize(
    "steps",
    [[0, 1, 1], [0, 2, 3], [1, 2, 3], [0, -1, 1], [0, 0, 2]],
    ids=["duplicate", "gap", "no-zero", "negative", "duplicate-and-gap"],
)
def test_layout_rejects_steps_that_are_not_0_to_n_minus_1(steps):
    tid = np.zeros(3, np.int64)
    assert not level_layout(tid, np.array(steps))[2]


def test_pools_group_by_exact_string_within_group():
    gid = np.array([0, 0, 0, 1, 1, 1])
    keys = pl.Series(["a", "b", "a", "a", "a", "c"])
    pool, asked = pools.pool_ids(gid, keys, np.array([0, 1, 1]), pl.Series(["b", "b", "c"]))
    assert pool[0] == pool[2] != pool[1]
    assert pool[3] == pool[4] != pool[0]  # same string, other group: other pool
    assert len(set(pool.tolist())) == 4
    assert asked.tolist() == [pool[1], pools.NO_POOL, pool[5]]


def test_hash_collisions_fall_back_to_the_exact_group_by(monkeypatch):
    """Force every string onto one hash: the second hash catches it, pools stay exact."""
    real_keys = pools._keys

    def colliding(gid, keys, group_bits):
        packed, check = real_keys(gid, keys, group_bits)
        return packed & ~np.uint64((1 << (64 - group_bits)) - 1), check

    monkeypatch.setattr(pools, "_keys", colliding)
    gid = np.array([0, 0, 0, 1])
    keys = pl.Series(["a", "b", "a", "a"])
    pool, asked = pools.pool_ids(gid, keys, np.array([0, 0]), pl.Series(["b", "zz"]))
    assert pool[0] == pool[2] and len({pool[0], pool[1], pool[3]}) == 3
    assert asked.tolist() == [pool[1], pools.NO_POOL]


def test_grouped_values():
    pool = np.array([0, 1, 0, 1])
    next_pool = np.array([1, pools.NO_POOL, 1, pools.NO_POOL])
    returns = np.array([1.0, 2.0, 3.0, 4.0])
    value, next_value, size = pools.grouped_values(returns, pool, next_pool)
    assert value.tolist() == [2.0, 3.0, 2.0, 3.0]
    assert next_value.tolist() == [3.0, 0.0, 3.0, 0.0]
    assert size.tolist() == [2, 2, 2, 2]


def test_next_in_rollout_keeps_integer_dtype():
    tid, step = shuffled_rollouts([2, 3], seed=5)
    pos, rem, _ = level_layout(tid, step)
    got = next_in_rollout(tid * 10 + step, pos, rem, fill=-1)
    assert got.dtype == tid.dtype
    assert np.array_equal(got, np.where(rem > 0, tid * 10 + step + 1, -1))

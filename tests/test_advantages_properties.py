"""Invariants of the advantage stage on random batches (hypothesis)."""

from __future__ import annotations

import numpy as np
import polars as pl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gagpo.pipeline import compute_advantages, parse_estimator_config
from gagpo.pipeline.config import ESTIMATOR_NAMES, NORMS
from gagpo.schemas import columns as C
from tests.helpers.advantages import assert_matches_reference, rollout, steps_frame

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
rewards = st.one_of(
    st.sampled_from([0.0, 1.0, -0.5]), st.floats(-10, 10, allow_nan=False, width=32)
)


@st.composite
def batches(draw, max_groups: int = 4):
    """{group_id: [rollout specs]}: few states per group, so pools repeat."""
    groups = {}
    for g in range(draw(st.integers(1, max_groups))):
        alphabet = [f"s{i}" for i in range(draw(st.integers(1, 5)))]
        state = st.sampled_from(alphabet)
        rollouts = []
        for _ in range(draw(st.integers(1, 4))):
            n = draw(st.integers(1, 8))
            end = draw(st.sampled_from(["done", "truncated"]))
            nxt = (
                draw(st.one_of(state, st.just("unseen"), st.none())) if end == "truncated" else None
            )
            rollouts.append(
                rollout(
                    draw(st.lists(state, min_size=n, max_size=n)),
                    draw(st.lists(rewards, min_size=n, max_size=n)),
                    end,
                    nxt,
                )
            )
        groups[f"g{g}"] = rollouts
    return groups


configs = st.builds(
    lambda name, norm, gamma, lam: parse_estimator_config(
        {
            "estimator": name,
            "norm": norm,
            "gamma": gamma,
            **({"lam": lam} if name == "gagpo" else {}),
        }
    ),
    st.sampled_from(ESTIMATOR_NAMES),
    st.sampled_from(NORMS),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
)


def advantages(frame: pl.DataFrame, config) -> pl.DataFrame:
    return compute_advantages(frame.lazy(), config).collect().sort(C.TRAJ_ID, C.STEP)


@SETTINGS
@given(batches(), configs)
def test_any_batch_and_config_matches_reference(groups, config):
    assert_matches_reference(steps_frame(groups), config)


@SETTINGS
@given(batches(), st.floats(0.0, 1.0))
def test_lambda_one_is_return_minus_value_proxy(groups, gamma):
    """GAE with λ = 1 telescopes to G_t − V̂(s_t), plus γ^(T−t)·V̂(next) after a bootstrap."""
    frame = steps_frame(groups)
    config = parse_estimator_config({"estimator": "gagpo_lambda1", "gamma": gamma, "norm": "none"})
    out = advantages(frame, config).with_columns(
        pl.col(C.STEP).max().over(C.TRAJ_ID).alias("last"),
        pl.col(C.NEXT_VALUE_PROXY).last().over(C.TRAJ_ID).alias("bootstrap"),
    )
    to_end = (out["last"] - out[C.STEP] + 1).to_numpy()
    expected = (
        out[C.RETURN].to_numpy()
        - out[C.VALUE_PROXY].to_numpy()
        + gamma**to_end * out["bootstrap"].to_numpy()
    )
    scale = 1.0 + np.abs(out[C.RETURN].to_numpy()).max()
    assert np.abs(out[C.ADVANTAGE_RAW].to_numpy() - expected).max() <= 1e-9 * scale
    # Rollouts that end in `done` have no bootstrap: exactly G_t − V̂(s_t) up to rounding.
    ends_done = frame.group_by(C.TRAJ_ID).agg(pl.col(C.DONE).any())
    done = out.join(ends_done, on=C.TRAJ_ID).filter(pl.col(C.DONE))
    gap = (done[C.ADVANTAGE_RAW] - (done[C.RETURN] - done[C.VALUE_PROXY])).abs()
    assert gap.max() is None or gap.max() <= 1e-9 * scale


@SETTINGS
@given(batches())
def test_lambda_zero_is_td_residual(groups):
    out = advantages(
        steps_frame(groups), parse_estimator_config({"estimator": "gagpo_lambda0", "norm": "none"})
    )
    assert out[C.ADVANTAGE_RAW].to_list() == out[C.TD_RESIDUAL].to_list()


@SETTINGS
@given(batches(), st.sampled_from(["gagpo", "gagpo_lambda0", "gagpo_lambda1"]))
def test_group_normalised_advantages_have_zero_mean_unit_std(groups, name):
    config = parse_estimator_config({"estimator": name})
    out = advantages(steps_frame(groups), config)
    stats = out.group_by(C.GROUP_ID).agg(
        pl.col(C.ADVANTAGE).mean().alias("mean"),
        pl.col(C.ADVANTAGE).std(ddof=0).alias("std"),
        pl.col(C.ADVANTAGE_RAW).std(ddof=0).alias("raw_std"),
    )
    assert stats["mean"].abs().max() <= 1e-9
    # Population std of (Â − mean)/(std + ε) is std/(std + ε): 1 up to ε, 0 for a constant group.
    expected = stats["raw_std"] / (stats["raw_std"] + config.eps)
    assert (stats["std"] - expected).abs().max() <= 1e-9


@SETTINGS
@given(batches(), configs, st.randoms(use_true_random=False))
def test_permuting_rows_changes_nothing(groups, config, rng):
    frame = steps_frame(groups)
    order = list(range(frame.height))
    rng.shuffle(order)
    base = advantages(frame, config)
    shuffled = advantages(frame[order], config)
    assert base.select(C.TRAJ_ID, C.STEP, C.STATE_GROUP_SIZE).equals(
        shuffled.select(C.TRAJ_ID, C.STEP, C.STATE_GROUP_SIZE)
    )
    for name in (C.RETURN, C.VALUE_PROXY, C.TD_RESIDUAL, C.ADVANTAGE_RAW, C.ADVANTAGE):
        assert np.abs(base[name].to_numpy() - shuffled[name].to_numpy()).max(initial=0) <= 1e-9

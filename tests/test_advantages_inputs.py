"""Bad steps are rejected with one line naming the column or the first offending rows."""

from __future__ import annotations

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from gagpo.pipeline import compute_advantages, parse_estimator_config
from gagpo.schemas import columns as C
from gagpo.schemas.errors import ValidationError
from tests.helpers.advantages import rollout, steps_frame

GOOD = steps_frame(
    {
        "g1": [rollout("abc", [0, 0, 1]), rollout("ab", [0, 1], "truncated", "c")],
        "g2": [rollout("xy", [1, 0])],
    }
)


def collect(frame: pl.DataFrame) -> pl.DataFrame:
    return compute_advantages(frame.lazy(), parse_estimator_config({})).collect()


def reject(frame: pl.DataFrame, *fragments: str) -> str:
    with pytest.raises(ValidationError) as info:
        collect(frame)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_good_frame_passes():
    assert collect(GOOD).height == GOOD.height


@pytest.mark.parametrize("column", C.ADVANTAGE_INPUT_COLUMNS)
def test_missing_column_is_named_before_any_data_is_read(column):
    with pytest.raises(ValidationError, match=f"missing column\\(s\\) {column};"):
        compute_advantages(GOOD.drop(column).lazy(), parse_estimator_config({}))


def test_wrong_type_is_named():
    frame = GOOD.with_columns(pl.col(C.DONE).cast(pl.Int8))
    with pytest.raises(ValidationError, match="column done has type Int8; accepted: bool"):
        compute_advantages(frame.lazy(), parse_estimator_config({}))


def test_duplicate_step_names_rollout_step_and_rows():
    frame = pl.concat([GOOD, GOOD[1:2]])
    reject(frame, "duplicate (traj_id, step) = ('g1/r0', 1)", "rows 1, 7")


def test_gap_in_step_names_rollout_and_missing_step():
    frame = GOOD.filter(~((pl.col(C.TRAJ_ID) == "g1/r0") & (pl.col(C.STEP) == 1)))
    reject(frame, "gap in step", "'g1/r0'", "no step 1")


def test_rollout_not_starting_at_zero():
    frame = GOOD.with_columns(
        pl.when(pl.col(C.TRAJ_ID) == "g2/r0")
        .then(pl.col(C.STEP) + 1)
        .otherwise(pl.col(C.STEP))
        .alias(C.STEP)
    )
    reject(frame, "gap in step", "'g2/r0'", "no step 0")


def test_negative_step():
    frame = GOOD.with_columns(
        pl.when(pl.int_range(pl.len()) == 3).then(-1).otherwise(pl.col(C.STEP)).alias(C.STEP)
    )
    reject(frame, "negative step at row 3")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reward_names_row(bad):
    frame = GOOD.with_columns(
        pl.when(pl.int_range(pl.len()) == 4).then(bad).otherwise(pl.col(C.REWARD)).alias(C.REWARD)
    )
    reject(frame, "column reward holds", "row 4 (traj_id 'g1/r1', step 1)", "finite")


@pytest.mark.parametrize("column", [C.GROUP_ID, C.TRAJ_ID, C.STATE_KEY, C.REWARD, C.DONE])
def test_null_in_required_column(column):
    frame = GOOD.with_columns(
        pl.when(pl.int_range(pl.len()) == 2).then(None).otherwise(pl.col(column)).alias(column)
    )
    reject(frame, f"column {column} holds a null at row 2")


def test_flag_before_the_end_of_a_rollout():
    frame = GOOD.with_columns((pl.col(C.DONE) | (pl.int_range(pl.len()) == 0)).alias(C.DONE))
    reject(frame, "done is set at row 0", "goes on for 2 more step(s)")


def test_rollout_without_an_end():
    frame = GOOD.with_columns(
        pl.when(pl.col(C.TRAJ_ID) == "g2/r0").then(False).otherwise(pl.col(C.DONE)).alias(C.DONE)
    )
    reject(frame, "rollout 'g2/r0' stops at step 1 without done or truncated")


def test_rollout_in_two_groups():
    frame = GOOD.with_columns(
        pl.when(pl.int_range(pl.len()) == 2)
        .then(pl.lit("g2"))
        .otherwise(pl.col(C.GROUP_ID))
        .alias(C.GROUP_ID)
    )
    reject(frame, "rollout 'g1/r0' appears in several groups ('g1', 'g2')")


def test_interleaved_rollouts_and_groups_are_fine():
    """Rows in any order, rollouts and groups not contiguous: same result as sorted."""
    shuffled = GOOD.sort(C.STEP, C.STATE_KEY, descending=True)
    assert_frame_equal(
        collect(shuffled).sort(C.TRAJ_ID, C.STEP),
        collect(GOOD).sort(C.TRAJ_ID, C.STEP),
        check_exact=False,
        rel_tol=0.0,
        abs_tol=1e-12,
    )

"""The learning benchmark's measurement (benchmarks/learning/run_learning.py `measure`):
exact values on a store whose answer is known (curve, advantage spread, held-out rows),
and on a real sokoban store the same numbers counted from its shards directly, the credit
AUC by brute force, all of it JSON as result.json holds it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from gagpo.schemas import columns as C
from gagpo.schemas.layout import EVAL, HELDOUT
from gagpo.storage.store import Store
from tests.helpers.actors import small_sokoban
from tests.helpers.steps import make_steps

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_learning():
    sys.path.insert(0, str(ROOT / "benchmarks" / "learning"))
    try:
        import run_learning

        yield run_learning
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "learning"))


def test_measure_of_a_sokoban_store_is_json(tmp_path: Path, run_learning):
    store = tmp_path / "store"
    small_sokoban(store, groups=2, run_id="bench")
    advantages = [
        sys.executable,
        "-m",
        "gagpo.workflows.cli",
        "advantages",
        "--store",
        str(store),
        "--estimator",
        "gagpo",
    ]
    subprocess.run(advantages, check=True, capture_output=True, timeout=300)

    result = run_learning.measure(store, "sokoban")
    again = json.loads(json.dumps(result))  # what run_cell writes
    steps = pl.concat(
        [
            pl.from_arrow(t)
            for _, t in Store(str(store)).iter_valid_shards(Store(str(store)).list_shards())
        ]
    )
    last = steps.sort(C.STEP).group_by(C.TRAJ_ID).agg(pl.col(C.WON).last())
    assert again["versions"] == [0] and again["rollouts"] == [8] == [last.height]
    assert again["env_steps"] == [steps.height]
    assert again["success"] == [pytest.approx(last[C.WON].mean())]
    assert again["valid"] == [pytest.approx(steps[C.ACTION_VALID].mean())]
    assert again["advantage_rows"] == steps.height
    own = pl.read_parquet(sorted((store / "advantages").glob("*/*.parquet")))
    q1, q3 = np.quantile(own[C.ADVANTAGE].to_numpy(), [0.25, 0.75])
    assert again["advantage_iqr"] == pytest.approx(q3 - q1)
    assert not math.isnan(again["credit_auc"])  # both kinds of move were played
    assert_credit_auc(steps, own, again["credit_auc"])


def assert_credit_auc(steps: pl.DataFrame, adv_table: pl.DataFrame, auc) -> None:
    """The AUC as the share of (optimal, other) pairs the advantage orders right, ties ½."""
    from credit import label

    labelled = label(steps).join(
        adv_table.select(C.TRAJ_ID, C.STEP, C.ADVANTAGE), on=[C.TRAJ_ID, C.STEP]
    )
    x, y = labelled[C.ADVANTAGE].to_numpy(), labelled["optimal"].to_numpy()
    pos, neg = x[y], x[~y]
    if not len(pos) or not len(neg):
        assert math.isnan(auc)
        return
    pairs = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    assert auc == pytest.approx(float(pairs.mean()))


def known_store(root: Path) -> Store:
    """v0: rollouts of 2, 3 and 4 steps, the second lost, the first's first reply invalid;
    v1: two won one-step rollouts. Advantages 0..8 on v0's steps; two held-out rows."""
    store = Store(str(root))
    a = make_steps(shard_id="a", groups=1, group_size=3, lengths=[2, 3, 4], policy_version=0)
    lost = pc.equal(a[C.TRAJ_ID], "a-g0-r1")
    invalid = pc.and_(pc.equal(a[C.TRAJ_ID], "a-g0-r0"), pc.equal(a[C.STEP], 0))
    for name, values in (
        (C.WON, pc.and_(a[C.WON], pc.invert(lost))),
        (C.ACTION_VALID, pc.invert(invalid)),
    ):
        i = a.schema.get_field_index(name)
        a = a.set_column(i, a.schema.field(i), values)
    store.write_shard(a, group_size=3)
    b = make_steps(shard_id="b", groups=1, group_size=2, lengths=[1, 1], policy_version=1)
    store.write_shard(b, group_size=2)
    n = a.num_rows
    adv = {
        C.TRAJ_ID: a[C.TRAJ_ID],
        C.STEP: a[C.STEP],
        C.GROUP_ID: a[C.GROUP_ID],
        C.STATE_KEY: a[C.STATE_KEY],
        **{
            c: pa.array([0.0] * n)
            for c in (C.RETURN, C.VALUE_PROXY, C.NEXT_VALUE_PROXY, C.TD_RESIDUAL, C.ADVANTAGE_RAW)
        },
        C.ADVANTAGE: pa.array(np.arange(n, dtype=float)),
        C.STATE_GROUP_SIZE: pa.array([1] * n, pa.int64()),
    }
    meta = {C.META_ESTIMATOR: b"gagpo", C.META_ESTIMATOR_PARAMS: b"{}"}
    store.write_parquet(
        pa.table(adv).cast(C.ADVANTAGES_SCHEMA), store.advantages_path("gagpo", "a"), meta
    )
    heldout = [
        {
            "policy_version": 0,
            "rollouts": 4,
            "success_rate": 0.25,
            "valid_rate": 0.5,
            "mean_return": 0.25,
            "task_seed": 7,
        },
        {
            "policy_version": 1,
            "rollouts": 4,
            "success_rate": 0.75,
            "valid_rate": 1.0,
            "mean_return": 0.75,
            "task_seed": 7,
        },
    ]
    table = pa.Table.from_pylist(heldout, schema=C.HELDOUT_SCHEMA)
    store.write_parquet(table, store.path(EVAL, HELDOUT), {})
    return store


def test_measure_of_a_store_whose_answer_is_known(tmp_path: Path, run_learning):
    store = known_store(tmp_path / "store")
    result = json.loads(json.dumps(run_learning.measure(store.root, "household")))
    assert result == {
        "versions": [0, 1],
        "rollouts": [3, 2],
        "env_steps": [9, 11],  # cumulative: 2 + 3 + 4, then 1 + 1
        "success": [pytest.approx(2 / 3), 1.0],
        "valid": [pytest.approx(8 / 9), 1.0],
        "advantage_iqr": 4.0,  # quartiles of 0..8: 2 and 6
        "advantage_rows": 9,
        "heldout": {
            "versions": [0, 1],
            "env_steps": [0, 9],  # before v0 played nothing was generated; before v1, v0's 9
            "success": [0.25, 0.75],
            "valid": [0.5, 1.0],
            "rollouts": [4, 4],
        },
    }

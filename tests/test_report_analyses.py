"""`gagpo report`'s three analyses of the paper (issue 45), against a brute-force count.

Two stores of known rollouts (random lengths and outcomes from a seeded generator, shards
committed at known minutes in an order their ids do not follow) and known learner metrics:
the windows of environment steps, the success rate, the steps per success and the
smoothness statistics of the report are recomputed here in plain Python.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pyarrow as pa
import pytest

from gagpo.inspection.report import write_report
from gagpo.inspection.report_analyses import WINDOWS
from gagpo.inspection.report_base import fmt
from gagpo.schemas import columns as C
from gagpo.storage.store import Store
from tests.helpers.sql import rollout

GROUP_SIZE = 3


def _known_run(root, seed: int, shards: int) -> tuple[Store, list[list[tuple[int, bool]]]]:
    """`shards` shards of one group each; returns the (length, success) of each rollout
    per shard in commit order (shard k starts at minute k; its id runs backwards)."""
    rng = random.Random(seed)
    store = Store(str(root))
    played = []
    for k in range(shards):
        shard = f"s{shards - k:03d}"  # ids in the reverse of commit order
        rows, outcome = [], []
        for j in range(GROUP_SIZE):
            length = rng.randint(1, 6)
            won = rng.random() < 0.2 + 0.6 * k / shards  # it gets better
            rows += rollout(
                f"g{shard}",
                f"{shard}-r{j}",
                [f"x{t}" for t in range(length)],
                [0.0] * (length - 1) + [1.0 if won else 0.0],
                shard=shard,
                env="grid",
                version=k,
                end="done" if won else "truncated",
                minute=k,
            )
            outcome.append((length, won))
        store.write_shard(pa.Table.from_pylist(rows, schema=C.STEPS_SCHEMA), group_size=GROUP_SIZE)
        played.append(outcome)
    return store, played


def _brute_windows(played, e: int, k: int) -> dict[int, dict]:
    """Shard by shard in commit order: cumulative steps s, window w with s in (w·e/k,
    (w+1)·e/k], kept while s ≤ e."""
    out: dict[int, dict] = {}
    cumulative = 0
    for outcome in played:
        cumulative += sum(length for length, _ in outcome)
        if cumulative > e:
            break
        w = math.ceil(cumulative * k / e) - 1
        cell = out.setdefault(w, {"episodes": 0, "successes": 0, "steps": 0, "won_steps": 0})
        cell["episodes"] += len(outcome)
        cell["successes"] += sum(won for _, won in outcome)
        cell["steps"] += sum(length for length, _ in outcome)
        cell["won_steps"] += sum(length for length, won in outcome if won)
    return out


def _write_metrics(store: Store, columns: dict[str, list]) -> None:
    table = pa.table(columns)
    store.write_parquet(table, store.path("learner", "metrics", "m.parquet"), {})


def _table_rows(summary: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after `heading`."""
    lines = summary.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.fixture
def two_runs(tmp_path):
    a, played_a = _known_run(tmp_path / "a", seed=1, shards=23)
    b, played_b = _known_run(tmp_path / "b", seed=2, shards=17)
    loss = [0.5, 0.2, float("nan"), 0.4, -0.1, 0.3]
    _write_metrics(
        a,
        {
            "update": [1, 2, 3, 4, 6, 7],  # update 5 not recorded, 3 not finite
            "version": [1, 2, 3, 4, 6, 7],
            "loss": loss,
            "grad_norm": [1.0, 3.0, 2.0, 2.5, 0.5, 1.0],
            "approx_kl": [0.0, 0.01, 0.03, None, 0.02, 0.02],
        },
    )
    _write_metrics(b, {"update": [1, 2], "version": [1, 2], "loss": [1.0, 0.25]})
    return (a, played_a), (b, played_b)


def test_windows_and_efficiency_match_a_brute_force_count(two_runs, tmp_path):
    (a, played_a), (b, played_b) = two_runs
    report = write_report([f"gagpo={a.root}", f"grpo={b.root}"], tmp_path / "r")
    names = {p.name for p in report.figures}
    assert {"early_learning.png", "interaction_efficiency.png", "smoothness.png"} <= names
    summary = report.summary.read_text()

    totals = [sum(n for shard in p for n, _ in shard) for p in (played_a, played_b)]
    e = min(totals)  # the shared budget: the shorter run's steps
    assert f"first {e} environment steps" in summary
    brute = [_brute_windows(p, e, WINDOWS) for p in (played_a, played_b)]
    # a longer run is cut at the budget: its windows hold fewer shards than it played
    assert sum(c["episodes"] for c in brute[0].values()) < len(played_a) * GROUP_SIZE

    success = _table_rows(summary, "### Early learning")
    assert success[0] == [
        "env steps ≤",
        "gagpo success",
        "gagpo episodes",
        "grpo success",
        "grpo episodes",
    ]
    efficiency = _table_rows(summary, "### Interaction efficiency")
    for w in range(WINDOWS):
        row, eff = success[2 + w], efficiency[2 + w]
        assert row[0] == str(round(e * (w + 1) / WINDOWS)) == eff[0]
        for r, cells in enumerate(brute):
            c = cells.get(w)
            rate = c["successes"] / c["episodes"] if c else None
            per_success = c["steps"] / c["successes"] if c and c["successes"] else None
            length = c["won_steps"] / c["successes"] if c and c["successes"] else None
            assert row[1 + 2 * r] == fmt(rate)
            assert row[2 + 2 * r] == str(c["episodes"] if c else 0)
            assert eff[1 + 2 * r] == fmt(per_success)
            assert eff[2 + 2 * r] == fmt(length)
    # the closing row: the whole budget
    whole = [{k: sum(c[k] for c in cells.values()) for k in brute[0][0]} for cells in brute]
    assert success[-1][0] == f"all ≤ {e}"
    assert success[-1][1] == fmt(whole[0]["successes"] / whole[0]["episodes"])
    assert efficiency[-1][3] == fmt(whole[1]["steps"] / whole[1]["successes"])


def test_smoothness_matches_numpy(two_runs, tmp_path):
    (a, _), (b, _) = two_runs
    report = write_report([f"gagpo={a.root}", f"grpo={b.root}"], tmp_path / "r")
    rows = _table_rows(report.summary.read_text(), "### Smoothness")
    header = rows[0]
    assert header == [
        "run",
        "metric",
        "updates",
        "mean",
        "mean_abs_diff",
        "std_abs_diff",
        "max_abs_diff",
    ]
    got = {(r[0], r[1]): r for r in rows[2:]}
    # kl_ref and mismatch_kl were never recorded: no row; b recorded only the loss
    assert set(got) == {
        ("gagpo", "loss"),
        ("gagpo", "grad_norm"),
        ("gagpo", "approx_kl"),
        ("grpo", "loss"),
    }
    expected = {
        ("gagpo", "loss"): [0.5, 0.2, 0.4, -0.1, 0.3],  # the NaN of update 3 left out
        ("gagpo", "grad_norm"): [1.0, 3.0, 2.0, 2.5, 0.5, 1.0],
        ("gagpo", "approx_kl"): [0.0, 0.01, 0.03, 0.02, 0.02],
        ("grpo", "loss"): [1.0, 0.25],
    }
    for key, values in expected.items():
        diffs = np.abs(np.diff(np.array(values)))
        row = got[key]
        assert row[2] == str(len(values))
        assert row[3] == fmt(float(np.mean(values)))
        assert row[4] == fmt(float(diffs.mean()))
        assert row[5] == fmt(float(diffs.std()))
        assert row[6] == fmt(float(diffs.max()))


def test_one_run_reads_its_own_budget_and_says_what_is_missing(tmp_path):
    store, played = _known_run(tmp_path / "solo", seed=3, shards=12)
    report = write_report(store, tmp_path / "r")
    summary = report.summary.read_text()
    total = sum(n for shard in played for n, _ in shard)
    assert f"first {total} environment steps" in summary
    rows = _table_rows(summary, "### Early learning")
    all_episodes = int(rows[-1][2])
    assert all_episodes == len(played) * GROUP_SIZE  # one run: nothing cut
    assert "No learner metrics yet." in summary
    assert "smoothness.png" not in {p.name for p in report.figures}

    (tmp_path / "nothing").mkdir()
    empty = write_report(str(tmp_path / "nothing"), tmp_path / "r2")
    assert "No environment steps yet" in empty.summary.read_text()

"""The learning benchmark's measurement (benchmarks/learning/run_learning.py `measure`) on
a real sokoban store: what a cell writes to result.json must serialise, with the curve, the
advantage spread and the credit AUC of the run's own advantages."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

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
    actors = [sys.executable, "-m", "gagpo.actors.cli", "--store", str(store), "--env", "sokoban",
              "--set", "env_options={sizes=[5,5],max_boxes=1}", "--groups", "2",
              "--group-size", "4", "--max-turns", "3", "--quiet"]  # fmt: skip
    subprocess.run(actors, check=True, capture_output=True, timeout=300)
    advantages = [sys.executable, "-m", "gagpo.workflows.cli", "advantages", "--store", str(store),
                  "--estimator", "gagpo"]  # fmt: skip
    subprocess.run(advantages, check=True, capture_output=True, timeout=300)

    result = run_learning.measure(store, "sokoban")
    again = json.loads(json.dumps(result))  # what run_cell writes
    assert again["versions"] == [0] and again["rollouts"] == [8]
    assert len(again["env_steps"]) == 1 and 8 <= again["env_steps"][0] <= 24  # 8 rollouts, ≤ 3 moves
    assert 0.0 <= again["success"][0] <= 1.0 and 0.0 <= again["valid"][0] <= 1.0
    assert again["advantage_rows"] == again["env_steps"][0] and again["advantage_iqr"] >= 0.0
    auc = again["credit_auc"]
    assert auc is None or math.isnan(auc) or 0.0 <= auc <= 1.0

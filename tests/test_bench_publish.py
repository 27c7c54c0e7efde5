"""benchmarks/bench_publish.py drives the learner's own publication path (Trainer's
take_version → release_version → finish) for a few updates of `tiny`: it runs, and its
rows say what the two settings write. A rename in learner/train.py broke it once unseen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_publish_runs_the_learners_path_on_tiny(tmp_path: Path):
    rows_file = tmp_path / "rows.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_publish.py"),
            "--policy",
            "tiny",
            "--before-updates",
            "2",
            "--after-updates",
            "2",
            "--json",
            str(rows_file),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["setting"]: r for r in json.loads(rows_file.read_text())}
    assert set(rows) == {"before", "after"}
    assert all(r["updates"] == 2 and r["parameters"] == 103_680 for r in rows.values())
    # "after" publishes bf16 (half the bytes of fp32 weights) and no longer writes the
    # optimiser state every update: fewer bytes per update.
    assert rows["after"]["bytes_per_update"] < rows["before"]["bytes_per_update"]
    assert "| tiny | 0.1 M | before | 2 |" in result.stdout

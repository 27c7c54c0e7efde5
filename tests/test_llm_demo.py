"""`make demo-llm`'s recipe, llm-demo, runs end to end for 2 updates: SmolLM2-135M-Instruct
as the actor's and the learner's (bf16) policy on guess_number, the held-out evaluation of
v0 and the last version, the report and the credit comparison (guess_number has a step
oracle). Only the sizes are cut (one group of 2 rollouts an update, 1 held-out task)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from gagpo.storage.store import Store

SMALL = [
    "--set", "learner.updates=2",
    "--set", "learner.batch_groups=1",
    "--set", "actors.group_size=2",
    "--set", "run.eval_groups=1",
]  # fmt: skip


@pytest.mark.slow  # 1-4 minutes on 2 shared cores: two model loads, generation, evaluation
def test_llm_demo_recipe_runs_two_updates(tmp_path: Path):
    store_dir = tmp_path / "store"
    command = [sys.executable, "-m", "gagpo.workflows.cli", "run", "--recipe", "llm-demo"]
    result = subprocess.run(
        [*command, "--store", str(store_dir), *SMALL],
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    store = Store(str(store_dir))
    assert store.policies.latest() == 2
    metrics = pq.read_table(store_dir / "learner" / "metrics").to_pydict()
    assert metrics["update"] == [1, 2]
    heldout = pq.read_table(store_dir / "eval" / "heldout.parquet").to_pydict()
    assert heldout["policy_version"] == [0, 2] and heldout["rollouts"] == [2, 2]
    assert re.search(r"held-out success: v0 [\d.]+% .* → v2 ", result.stdout)
    assert (store_dir / "report" / "summary.md").is_file()
    assert "credit on this run's own" in result.stdout

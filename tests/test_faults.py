"""Reliability under faults (issue 14): a short run of benchmarks/faults/run_faults.py
(actors and learner SIGKILLed while they share a local store), and the user errors of
`gagpo advantages` / `gagpo sql` that used to end in a traceback (case 4): one line, exit 2."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.steps import make_steps

ROOT = Path(__file__).resolve().parents[1]


def _fault_script():
    spec = importlib.util.spec_from_file_location(
        "run_faults", ROOT / "benchmarks" / "faults" / "run_faults.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_faults"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_short_fault_injection_run(tmp_path):
    """2 actor kills (one inside a shard commit), 2 learner kills (one held at a phase),
    then a drain: nothing torn, every group trained once, one lineage, LATEST sound."""
    faults = _fault_script()
    plan = faults.Plan(actor_kills=2, learner_kills=2, updates=3, actor_delay_s=4.0, seed=1)
    (figures,) = faults.run_faults(["local"], plan, tmp_path)
    assert figures.actor_kills == 2 and figures.actor_commit_kills == 1
    assert figures.learner_kills >= 1 and sum(figures.learner_hold_kills.values()) == 1
    assert figures.latest_polls > 0 and figures.latest_incomplete == 0
    assert figures.shards >= 3 and figures.bad_visible_shards == 0 and figures.quarantined == 0
    assert figures.groups_committed == figures.groups_in_ledger == figures.updates
    assert figures.groups_trained_twice == 0 and figures.groups_skipped == 0
    assert figures.versions == figures.updates + 1  # v0 .. vN, none skipped or discarded
    assert figures.update_version_mismatch == 0 and figures.lineage_problems == []
    assert figures.stale_temp_files_after_writer == 0  # the killed commit's temporary swept
    assert figures.ok


# --- case 4: user errors, one line and exit code 2 -------------------------------------
def gagpo(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gagpo.workflows.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(word in lines[0] for word in words), lines[0]


@pytest.fixture
def steps_file(tmp_path) -> Path:
    import pyarrow.parquet as pq

    path = tmp_path / "steps.parquet"
    pq.write_table(make_steps(), path)
    return path


@pytest.mark.parametrize(
    ("out", "words"),
    [("/proc/x.parquet", ("--out", "cannot be written")), ("{dir}", ("is a directory",))],
)
def test_advantages_out_errors(steps_file, tmp_path, out, words):
    out = out.format(dir=tmp_path)
    done = gagpo("advantages", "--input", str(steps_file), "--out", out, cwd=tmp_path)
    assert_one_line(done, *words)


def _immutable(folder: Path) -> bool:
    """Make `folder` unwritable even for root (chattr +i) where possible."""
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root: permissions do not bind
        chattr = shutil.which("chattr")
        if not chattr or subprocess.run([chattr, "+i", str(folder)]).returncode:
            folder.chmod(0o755)
            return False
    return True


def test_advantages_into_an_immutable_store(tmp_path):
    from gagpo.storage.store import Store

    root = tmp_path / "store"
    Store(str(root)).write_shard(make_steps(), group_size=3)
    if not _immutable(root):
        pytest.skip("cannot make a folder immutable here")
    try:
        done = gagpo("advantages", "--store", str(root), cwd=tmp_path)
    finally:
        if shutil.which("chattr"):
            subprocess.run(["chattr", "-i", str(root)], capture_output=True)
        root.chmod(0o755)
    assert_one_line(done, "cannot be written")
    assert not (root / "advantages").exists()


def test_sql_on_a_file_and_into_a_missing_folder(tmp_path, store_dir):
    assert_one_line(gagpo("sql", "--store", "/etc/hostname", "select 1", cwd=tmp_path), "is a file")
    done = gagpo(
        "sql",
        "--store",
        str(store_dir),
        "--format",
        "csv",
        "--out",
        "/nonexistent/dir/x.csv",
        "select 1",
        cwd=tmp_path,
    )
    assert_one_line(done, "/nonexistent/dir", "does not exist")

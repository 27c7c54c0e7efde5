"""The tree is formatted and linted by ruff (pyproject.toml's settings): `make lint` runs the
same two checks. A formatting difference or a lint finding fails here, with ruff's list."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


@pytest.mark.parametrize("args", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff_finds_nothing(args):
    if not RUFF.exists():
        pytest.skip("ruff is not installed beside this Python (the dev extra installs it)")
    result = subprocess.run(
        [str(RUFF), *args, "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

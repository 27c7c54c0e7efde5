"""The umbrella `gagpo` CLI and `gagpo run` (actors and learner together from a recipe)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gagpo.workflows.cli import SUBCOMMANDS

GAGPO = [sys.executable, "-m", "gagpo.workflows.cli"]


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(name: str):
    result = subprocess.run([*GAGPO, name, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Usage: gagpo {name}")


def test_help_imports_no_heavy_library():
    code = (
        "import sys; from click.testing import CliRunner; from gagpo.workflows.cli import gagpo; "
        "[CliRunner().invoke(gagpo, [n, '--help']) for n in ('actors', 'learner', 'advantages', 'sql', 'run')]; "
        "print(sorted(m for m in ('torch', 'transformers', 'polars', 'duckdb', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_unknown_recipe_is_one_clear_line(tmp_path: Path):
    result = subprocess.run(
        [*GAGPO, "run", "--store", str(tmp_path / "s"), "--recipe", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "unknown recipe 'nope'; accepted: a TOML file or one of " in result.stderr
    assert all(name in result.stderr for name in ("demo", "tiny", "sokoban", "household"))
    assert "Traceback" not in result.stderr

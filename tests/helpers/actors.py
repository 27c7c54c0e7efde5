"""`gagpo-actors` in a child process, and marks for environments whose library is optional."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ACTORS = [sys.executable, "-m", "gagpo.actors.cli"]


def run_actors(
    *args: str, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`gagpo-actors --quiet *args`."""
    return subprocess.run(
        [*ACTORS, "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def run_actors_with(env_name: str, store: Path, *args: str) -> subprocess.CompletedProcess:
    """`gagpo-actors --env env_name` with the tiny policy into `store`."""
    return run_actors(
        "--store", str(store), "--env", env_name, "--policy", "tiny", *args, timeout=600
    )


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip where one of `modules` is not installed (`make install` installs them)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(
        bool(missing), reason=f"{', '.join(missing)} is not installed (make install installs it)"
    )

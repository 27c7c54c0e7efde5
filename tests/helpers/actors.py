"""`gagpo-actors` in a child process or as a config, and marks for environments whose library
is optional."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gagpo.actors.config import ActorConfig
from tests.helpers.argv import flags

ACTORS = [sys.executable, "-m", "gagpo.actors.cli"]


def actors_command(store: Path | str, *args: str, **options) -> list[str]:
    """`gagpo-actors --quiet` into `store` with the tiny policy (unless `options` name
    another), `options` as flags (`group_size=4` → `--group-size 4`), then `args`."""
    options = {"policy": "tiny", **options}
    return [*ACTORS, "--quiet", "--store", str(store), *flags(**options), *args]


def actor_config(store: Path, env: str, **overrides) -> ActorConfig:
    """Three groups of the tiny policy's rollouts on `env` into `store`: 5 turns, seed 11,
    run id `r`; `overrides` replace or add fields (the group size among them)."""
    base = dict(
        store=str(store), env=env, policy="tiny", groups=3, max_turns=5, seed=11, run_id="r"
    )
    return ActorConfig(**(base | overrides))


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


def small_sokoban(store: Path, *, groups: int, run_id: str) -> None:
    """Real rollouts of the untrained tiny policy into `store`: `groups` 5×5 one-box
    sokoban tasks × 4 rollouts of 3 turns, seed 0 (the same shards every time)."""
    sokoban = {"env": "sokoban", "set": "env_options={sizes=[5,5],max_boxes=1}"}
    cmd = actors_command(
        store, **sokoban, groups=groups, group_size=4, max_turns=3, run_id=run_id, seed=0
    )
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip where one of `modules` is not installed (`make install` installs them)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(
        bool(missing), reason=f"{', '.join(missing)} is not installed (make install installs it)"
    )

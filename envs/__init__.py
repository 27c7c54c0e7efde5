"""Environments: the built-in ones (sokoban, household, webshop, textworld, alfworld...),
the adapters for environments of other packages (gym_adapter, textarena_env, gem_env,
reasoning_gym_env, openenv_env, agent, verifiers_env), the agent endpoint, and the
registry that names and builds them all (envs/registry.py).

The registry's public names are re-exported here, imported on first use: importing
`gagpo.envs` (or any one environment's module) loads no adapter and no registry.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENVIRONMENTS",
    "FAMILIES",
    "FAMILY_PATTERNS",
    "capabilities_of",
    "check_env",
    "environment_names",
    "make_env",
    "plugin_environments",
    "step_oracle",
]

if TYPE_CHECKING:
    from gagpo.envs.registry import (
        ENTRY_POINT_GROUP,
        ENVIRONMENTS,
        FAMILIES,
        FAMILY_PATTERNS,
        capabilities_of,
        check_env,
        environment_names,
        make_env,
        plugin_environments,
        step_oracle,
    )


def __getattr__(name: str) -> object:
    if name in __all__:  # the registry's names: imported on first use
        return getattr(importlib.import_module("gagpo.envs.registry"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

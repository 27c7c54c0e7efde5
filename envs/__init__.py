"""Environments: the built-in ones (sokoban, household, webshop, textworld, alfworld...),
the adapters for environments of other packages (gym_adapter, textarena_env, gem_env,
reasoning_gym_env, openenv_env, agent, verifiers_env), the agent endpoint, and the
registry that names and builds them all (envs/registry.py).

The registry's public names are re-exported here, imported on first use: importing
`gagpo.envs` (or any one environment's module) loads no adapter and no registry.
"""

from __future__ import annotations

from gagpo.schemas.lazy import lazy_exports

_REGISTRY_NAMES = (
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
)
__all__, __getattr__, __dir__ = lazy_exports(
    __name__, dict.fromkeys(_REGISTRY_NAMES, "gagpo.envs.registry")
)

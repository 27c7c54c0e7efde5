"""The environment registry (envs/registry.py) is imported on first use of its names, and
loads an environment's or an adapter's module only when that name is used: importing
`gagpo.envs`, or listing every name `--env` accepts, loads none of them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gagpo.envs
from gagpo.envs import registry


def envs_modules_after(code: str) -> set[str]:
    """The gagpo.envs modules a fresh interpreter holds after running `code`."""
    probe = (
        f"{code}\nimport sys, json\n"
        "print(json.dumps([m for m in sys.modules if m.startswith('gagpo.envs')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_importing_the_package_loads_no_adapter_and_no_registry():
    assert envs_modules_after("import gagpo.envs") == {"gagpo.envs"}


def test_listing_the_names_loads_no_environment_and_no_adapter():
    loaded = envs_modules_after(
        "from gagpo.envs import environment_names\nassert 'sokoban' in environment_names()"
    )
    assert loaded == {"gagpo.envs", "gagpo.envs.registry", "gagpo.envs.base"}


def test_a_family_name_loads_its_adapter_alone():
    loaded = envs_modules_after("from gagpo.envs import capabilities_of\ncapabilities_of('gem/x')")
    adapters = {f"gagpo.envs.{w.split(':')[0]}" for w in registry.FAMILIES.values()}
    assert loaded & adapters == {"gagpo.envs.gem_env"}


def test_the_package_re_exports_the_registry():
    for name in gagpo.envs.__all__:
        assert getattr(gagpo.envs, name) is getattr(registry, name)
    with pytest.raises(AttributeError):
        gagpo.envs.no_such_name  # noqa: B018

"""The recipes shipped with GAGPO (`gagpo run --recipe NAME`): TOML files in this folder."""

from __future__ import annotations

from importlib import resources


def shipped() -> list[str]:
    """Names of the shipped recipes, sorted."""
    return sorted(
        p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".toml")
    )

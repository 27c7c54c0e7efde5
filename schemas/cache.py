"""The local cache folder every layer shares: converted presets, generated games, fetched
policy versions, warm starts.

`$GAGPO_CACHE`, default `~/.cache/gagpo`; an empty `GAGPO_CACHE` is the default too, and
`~` is expanded, so actors and learner on one machine always agree on the folder.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$GAGPO_CACHE`, default `~/.cache/gagpo`."""
    return Path(os.environ.get("GAGPO_CACHE") or Path.home() / ".cache" / "gagpo").expanduser()


def policy_cache_dir() -> Path:
    """Where policy versions fetched from a store are kept (`PolicyRegistry.fetch`, storage/registry.py)."""
    return cache_root() / "policies"

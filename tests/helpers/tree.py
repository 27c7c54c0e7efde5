"""The source tree as the structural tests read it: the root and the layer folders, in the
order of docs/design.md §2 (each installs as gagpo.<layer>)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = (
    "schemas",
    "storage",
    "envs",
    "actors",
    "pipeline",
    "inspection",
    "learner",
    "workflows",
)

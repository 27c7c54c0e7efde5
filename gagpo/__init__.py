"""GAGPO: Generalized Advantage Grouped Policy Optimization for multi-turn LLM agents.

The store as a library, in one call:

    import gagpo
    import polars as pl

    store = gagpo.open_store("runs/demo")          # or s3://bucket/run, as_of_update=N
    store.steps().filter(pl.col("reward") > 0).collect()
    store.sql("SELECT env, avg(success_rate) FROM groups GROUP BY env")

A mistake (a missing store, a bad URL or value) raises `gagpo.GagpoError`, one line.

The layers install beside this module: gagpo.schemas, gagpo.storage, gagpo.envs,
gagpo.actors, gagpo.pipeline, gagpo.inspection, gagpo.learner, gagpo.workflows
(docs/design.md §2). Importing `gagpo` loads nothing else until a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "open_store": "gagpo.inspection.library",
    "StoreReader": "gagpo.inspection.library",
    "GagpoError": "gagpo.schemas.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gagpo' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

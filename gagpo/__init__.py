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
(docs/design.md §2). Importing `gagpo` loads none of them until a name is used, but for
the helper that resolves the names (gagpo.schemas.lazy).
"""

from __future__ import annotations

from gagpo.schemas.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "open_store": "gagpo.inspection.library",
        "StoreReader": "gagpo.inspection.library",
        "GagpoError": "gagpo.schemas.errors",
    },
)

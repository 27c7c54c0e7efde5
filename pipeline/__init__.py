"""The advantage stage: GAGPO and its baselines as columnar transforms over stored steps.

    from gagpo.pipeline import compute_advantages, diagnostics, parse_estimator_config

    config = parse_estimator_config({"estimator": "gagpo", "gamma": 0.95, "lam": 0.8})
    table = compute_advantages(pl.scan_parquet("steps.parquet"), config).collect()
    print(diagnostics(table).format())

Imports Polars, NumPy and pydantic only, never torch; names resolve lazily so that
importing the config models (or `--help`) does not load Polars.
"""

from __future__ import annotations

from gagpo.schemas.lazy import lazy_exports

_EXPORTS = {  # name -> the module that defines it
    "ESTIMATORS": "gagpo.pipeline.advantages",
    "OUTPUT_SCHEMA": "gagpo.pipeline.advantages",
    "compute_advantages": "gagpo.pipeline.advantages",
    "register": "gagpo.pipeline.advantages",
    "ESTIMATOR_NAMES": "gagpo.pipeline.config",
    "EstimatorConfig": "gagpo.pipeline.config",
    "GagpoConfig": "gagpo.pipeline.config",
    "GagpoLambda0Config": "gagpo.pipeline.config",
    "GagpoLambda1Config": "gagpo.pipeline.config",
    "GigpoConfig": "gagpo.pipeline.config",
    "GrpoConfig": "gagpo.pipeline.config",
    "RlooConfig": "gagpo.pipeline.config",
    "parse_estimator_config": "gagpo.pipeline.config",
    "Diagnostics": "gagpo.pipeline.diagnose",
    "diagnostics": "gagpo.pipeline.diagnose",
    "recompute_files": "gagpo.pipeline.recompute",
    "recompute_store": "gagpo.pipeline.recompute",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

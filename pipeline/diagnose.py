"""Diagnostics of an advantages table, per group and per batch.

What they tell: how often the grouped value proxy is informative (a singleton state's
proxy is its own return, so its TD residual carries no baseline), how large the pools
are, and the spread of the advantages the learner will see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import polars as pl

from gagpo.schemas import columns as C

METRICS = {
    "singleton_state_rate": "share of steps whose state occurs once in their group",
    "mean_pool_size": "mean over steps of state_group_size (steps sharing the state)",
    "advantage_std": "population std of the advantage",
    "advantage_iqr": "interquartile range of the advantage (linear interpolation)",
    "share_abs_gt_1": "share of steps with |advantage| > 1",
}
# Pool-size distribution: the share of steps whose pool (state_group_size) falls in each bin.
POOL_SIZE_BINS = {
    "1": (1, 1),
    "2": (2, 2),
    "3-4": (3, 4),
    "5-8": (5, 8),
    "9-16": (9, 16),
    ">16": (17, None),
}


def _pool_size_shares() -> list[pl.Expr]:
    size = pl.col(C.STATE_GROUP_SIZE)
    return [
        (size.is_between(lo, hi) if hi else size >= lo).mean().alias(f"_pool_{name}")
        for name, (lo, hi) in POOL_SIZE_BINS.items()
    ]


def _metrics() -> list[pl.Expr]:
    size, adv = pl.col(C.STATE_GROUP_SIZE), pl.col(C.ADVANTAGE)
    return [
        pl.len().alias("steps"),
        pl.col(C.TRAJ_ID).n_unique().alias("rollouts"),
        (size == 1).mean().alias("singleton_state_rate"),
        size.mean().alias("mean_pool_size"),
        adv.std(ddof=0).alias("advantage_std"),
        (adv.quantile(0.75, "linear") - adv.quantile(0.25, "linear")).alias("advantage_iqr"),
        (adv.abs() > 1).mean().alias("share_abs_gt_1"),
    ]


@dataclass(frozen=True)
class Diagnostics:
    """`groups`: one row per group_id with steps, rollouts and the METRICS;
    `batch`: the same over all steps, plus the number of groups, `pool_size_share` (bin
    of POOL_SIZE_BINS → share of steps) and `state_grouping` (the mode, when known)."""

    groups: pl.DataFrame
    batch: dict[str, Any]

    def format(self) -> str:
        """Lines for a terminal: batch figures, then each metric's spread over groups."""
        b = self.batch
        lines = [f"steps {b['steps']}  rollouts {b['rollouts']}  groups {b['groups']}"]
        if b.get("state_grouping"):
            lines.append(f"{'state_grouping':<21} {b['state_grouping']}")
        for name in METRICS:
            value = b[name]
            text = "n/a" if value is None else f"{value:.4g}"
            if self.groups.height:
                col = self.groups[name].drop_nulls()
                if col.len():
                    text += f"   per group: min {col.min():.4g}  median {col.median():.4g}  max {col.max():.4g}"
            lines.append(f"{name:<21} {text}")
        shares = b.get("pool_size_share") or {}
        if shares and b["steps"]:
            text = "  ".join(f"{k}: {v:.1%}" for k, v in shares.items())
            lines.append(f"{'pool_size_share':<21} {text}   (share of steps by pool size)")
        return "\n".join(lines)


def diagnostics(
    advantages: pl.LazyFrame | pl.DataFrame, state_grouping: str | None = None
) -> Diagnostics:
    """Per-group and batch diagnostics of an advantages table (docs/design.md §3 columns);
    `state_grouping` names the grouping its pools were made under (shown when given)."""
    lf = advantages.lazy()
    groups = lf.group_by(C.GROUP_ID).agg(_metrics()).sort(C.GROUP_ID)
    batch = lf.select(
        pl.col(C.GROUP_ID).n_unique().alias("groups"), *_metrics(), *_pool_size_shares()
    )
    groups_df, batch_df = pl.collect_all([groups, batch])
    row = batch_df.row(0, named=True)
    shares = {name: row.pop(f"_pool_{name}") or 0.0 for name in POOL_SIZE_BINS}
    row["pool_size_share"] = shares
    row["state_grouping"] = state_grouping
    return Diagnostics(groups=groups_df, batch=row)

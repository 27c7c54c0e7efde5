"""`summary.md` of `gagpo report`: tables of the data, the policy versions, the advantages,
the learner and the held-out evaluation of each run, read through the SQL views."""

from __future__ import annotations

import math
from pathlib import Path

from gagpo.inspection.intervals import change_line, wilson
from gagpo.inspection.report_analyses import analyses_section
from gagpo.inspection.report_base import Run, query_rows
from gagpo.inspection.report_base import markdown_table as _table
from gagpo.inspection.report_figures import PER_VERSION

_TOTALS = """
SELECT count(DISTINCT shard_id) AS shards, count(DISTINCT group_id) AS groups,
       count(*) AS trajectories, coalesce(sum(length), 0) AS steps,
       avg(success::DOUBLE) AS success_rate, avg("return") AS mean_return
FROM trajectories
"""


def summary(runs: list[Run], figures: list[Path], notes: list[str]) -> str:
    """The Markdown summary of `runs`, listing `figures` and `notes`."""
    lines = ["# GAGPO store report", ""]
    if len(runs) == 1:
        lines += [f"Store: `{runs[0].store.url}`", ""]
    else:
        lines += ["## Runs compared", ""]
        rows = []
        for run in runs:
            totals = query_rows(run.con, _TOTALS)[0]
            last = query_rows(run.con, PER_VERSION)
            rows.append(
                {
                    "run": run.label,
                    "store": f"`{run.store.url}`",
                    **totals,
                    "last_version_success": last[-1]["success_rate"] if last else None,
                }
            )
        lines += _table(rows, list(rows[0]))
        lines += [*analyses_section(runs), ""]  # the runs side by side
    for run in runs:
        if len(runs) > 1:
            lines += [f"# Run `{run.label}`", ""]
        lines += _run_summary(run.con)
    if len(runs) == 1:
        lines += analyses_section(runs)
    lines += ["", "## Figures", ""]
    lines += [f"![{p.stem}]({p.name})" for p in figures] or ["none (no data yet)"]
    if notes:
        lines += ["", "## Notes", "", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"


# Modes the report always pools the store's steps under (pipeline/grouping.py), besides any
# state_grouping its advantage tables were computed with; similar:τ is a Python per-group
# map, so it is skipped above SIMILAR_MAX_STEPS.
GROUPING_MODES = ("exact", "normalized", "minhash:0.8", "similar:0.9")
SIMILAR_MAX_STEPS = 200_000
# shares of steps by their pool's size: (column, smallest size, largest size)
POOL_SIZE_BINS = (
    ("pool_1", 1, 1),
    ("pool_2-3", 2, 3),
    ("pool_4-7", 4, 7),
    ("pool_8+", 8, math.inf),
)


def grouping_rows(con, extra: tuple[str, ...] = ()) -> list[dict]:
    """Per state grouping, over the store's steps: pools, the share of steps whose pool is
    that step alone (singleton share) and of steps after the first turn, and the share of
    steps by pool size. One grouping pass per mode (no estimator)."""
    import json

    import numpy as np
    import polars as pl

    from gagpo.pipeline.grouping import group_states, parse_grouping

    steps = pl.from_arrow(con.sql("SELECT group_id, step, state_key FROM steps").to_arrow_table())
    if steps.height == 0:
        return []
    gid = (steps["group_id"].rank("dense") - 1).cast(pl.Int64).to_numpy()
    later = (steps["step"] > 0).to_numpy()
    used = []
    for (params,) in con.execute("SELECT params FROM estimators").fetchall():
        try:
            used.append(json.loads(params or "{}").get("state_grouping"))
        except (ValueError, AttributeError):
            continue
    modes = dict.fromkeys(m for m in (*GROUPING_MODES, *extra, *used) if m)
    rows = []
    for text in modes:
        grouping = parse_grouping(text)
        if grouping.mode == "similar" and steps.height > SIMILAR_MAX_STEPS:
            continue
        pools = group_states(
            grouping, gid, steps["state_key"], np.zeros(0, np.int64), pl.Series([], dtype=pl.String)
        )
        size = np.bincount(pools.pool)[pools.pool]
        row = {
            "state_grouping": grouping.spec,
            "steps": steps.height,
            "pools": int(pools.pool.max()) + 1,
            "singleton_share": float((size == 1).mean()),
            "singleton_share_after_turn_0": float((size[later] == 1).mean())
            if later.any()
            else None,
        }
        for name, low, high in POOL_SIZE_BINS:
            row[name] = float(((size >= low) & (size <= high)).mean())
        rows.append(row)
    return rows


def _run_summary(con) -> list[str]:
    """One run's sections: data, versions, advantages, state grouping, learner, held out."""
    return [
        *_data_section(con),
        *_versions_section(con),
        *_advantages_section(con),
        *_grouping_section(con),
        *_learner_section(con),
        *_heldout_section(con),
    ]


def _data_section(con) -> list[str]:
    totals = query_rows(con, _TOTALS)[0]
    lines = ["## Data", "", *_table([totals], list(totals))]
    per_env = query_rows(
        con,
        """
        SELECT env, count(*) AS groups, sum(rollouts) AS trajectories, sum(steps) AS steps,
               sum(success_rate * rollouts) / sum(rollouts) AS success_rate,
               sum(mean_return * rollouts) / sum(rollouts) AS mean_return,
               sum(singleton_states) / sum(steps) AS singleton_rate
        FROM groups GROUP BY env ORDER BY env
        """,
    )
    if per_env:
        lines += ["", *_table(per_env, list(per_env[0]))]
    return lines


def _versions_section(con) -> list[str]:
    lines = ["", "## Policy versions", ""]
    versions = query_rows(
        con,
        "SELECT version, published, stored, is_latest, steps, trajectories, success_rate, "
        "mean_return "
        "FROM policy_versions ORDER BY version DESC LIMIT 10",
    )
    lines += _table(versions, list(versions[0])) if versions else ["no policy versions yet"]
    return lines


def _advantages_section(con) -> list[str]:
    lines = ["", "## Advantages", ""]
    estimators = query_rows(
        con,
        """
        SELECT e.estimator, e.name, e.params, count(a.advantage) AS steps,
               avg(a.advantage) AS mean, stddev_pop(a.advantage) AS std,
               min(a.advantage) AS min, max(a.advantage) AS max,
               avg((abs(a.advantage) > 1)::DOUBLE) AS share_abs_gt_1
        FROM estimators e LEFT JOIN advantages a USING (estimator)
        GROUP BY ALL ORDER BY e.estimator
        """,
    )
    return lines + (
        _table(estimators, list(estimators[0])) if estimators else ["no advantages yet"]
    )


def _grouping_section(con) -> list[str]:
    lines = [
        "",
        "## State grouping",
        "",
        "The store's steps pooled under each state grouping (pipeline/grouping.py; "
        "`gagpo advantages --state-grouping MODE` recomputes under one): singleton "
        "share = steps whose pool is that step alone (GiGPO's step term is 0 there, "
        "GAGPO's value proxy is the step's own return); pool_a-b: share of steps in "
        "pools of that size.",
        "",
    ]
    grouping = grouping_rows(con)
    return lines + (_table(grouping, list(grouping[0])) if grouping else ["no steps yet"])


def _learner_section(con) -> list[str]:
    lines = ["", "## Learner", ""]
    learner = query_rows(
        con,
        """
        SELECT count(*) AS updates, max(version) AS last_version,
               arg_max(loss, "update") AS last_loss, avg(approx_kl) AS mean_approx_kl,
               avg(clip_frac) AS mean_clip_frac, max(behavior_weight_max) AS max_behavior_weight,
               max(staleness_max) AS max_staleness,
               max(stale_groups_total) AS stale_groups_dropped,
               sum(masked_actions) AS masked_actions
        FROM learner_metrics
        """,
    )[0]
    return lines + (
        _table([learner], list(learner)) if learner["updates"] else ["no learner metrics yet"]
    )


def _heldout_section(con) -> list[str]:
    heldout = query_rows(con, "SELECT * FROM heldout")
    if not heldout:
        return []
    for row in heldout:  # the 95 % Wilson interval of each success rate
        row["ci_low"], row["ci_high"] = wilson(
            row["success_rate"] * row["rollouts"], row["rollouts"]
        )
    first, last = heldout[0], heldout[-1]
    change = change_line(
        first["success_rate"], first["rollouts"], last["success_rate"], last["rollouts"]
    )
    return [
        "",
        "## Held-out evaluation",
        "",
        "Every version below played the same held-out tasks (`gagpo run`, [run] eval_groups); "
        "ci_low–ci_high: the 95 % Wilson interval of its success rate.",
        "",
        f"Held-out success v{first['policy_version']} → v{last['policy_version']}: "
        f"{first['success_rate']:.1%} → {last['success_rate']:.1%}, {change} "
        "(±: 95 % interval of the difference).",
        "",
        *_table(heldout, list(heldout[0])),
    ]

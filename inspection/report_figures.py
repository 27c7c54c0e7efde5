"""The figures of `gagpo report`, each a function of the runs' SQL connections (the views of
inspection/sql.py), with the SQL it draws from beside it. inspection/report.py says which
figure shows what, and writes them.
"""

from __future__ import annotations

import math
from pathlib import Path

from gagpo.inspection.intervals import wilson
from gagpo.inspection.report_base import (
    Run,
    colour,
    curve,
    empty,
    figure,
    finite,
    integer_ticks,
    legend,
    query_rows,
    save,
)

BINS = 50  # shared histogram bins for advantage distributions
CURVE_POINTS = 100  # shards are binned into at most this many points along training
SCATTER_POINTS = 3000  # steps sampled per estimator for the value-proxy scatter
MAX_TURNS_BY_TURN = 40  # the advantage-by-turn panel shows turns 0..this-1


# --- learning curves -----------------------------------------------------------------
# Shards in commit order (first step time, then id), binned, with cumulative env steps.
_CURVE_BY_STEPS = f"""
WITH per_shard AS (
    SELECT shard_id, min(started_at) AS started, sum(length) AS steps,
           count(*) AS trajectories, sum(success::INT) AS successes,
           sum("return") AS return_sum
    FROM trajectories GROUP BY shard_id
), binned AS (
    SELECT *, ntile({CURVE_POINTS}) OVER (ORDER BY started, shard_id) AS bin FROM per_shard
), points AS (
    SELECT bin, sum(steps) AS steps, sum(successes) / sum(trajectories) AS success_rate,
           sum(return_sum) / sum(trajectories) AS mean_return
    FROM binned GROUP BY bin
)
SELECT sum(steps) OVER (ORDER BY bin) AS env_steps, success_rate, mean_return
FROM points ORDER BY bin
"""
PER_VERSION = """
SELECT policy_version AS version, count(*) AS trajectories,
       avg(success::DOUBLE) AS success_rate, avg("return") AS mean_return,
       avg(length) AS episode_length, sum(invalid_actions) / sum(length) AS invalid_rate
FROM trajectories GROUP BY policy_version ORDER BY policy_version
"""


_HELDOUT = "SELECT policy_version AS version, success_rate, rollouts FROM heldout"


def plot_learning_curves(runs: list[Run], path: Path) -> bool:
    heldout = [query_rows(run.con, _HELDOUT) for run in runs]
    fig, axes = figure(1, 4 if any(heldout) else 3)
    panels = [
        (axes[0][0], "env_steps", "success_rate", "environment steps", "success rate"),
        (axes[0][1], "env_steps", "mean_return", "environment steps", "mean return"),
        (axes[0][2], "version", "success_rate", "policy version", "success rate"),
    ]
    if any(heldout):
        ax = axes[0][3]
        for i, (run, rows) in enumerate(zip(runs, heldout, strict=True)):
            if rows:
                xs = [r["version"] for r in rows]
                ax.plot(
                    xs,
                    [r["success_rate"] for r in rows],
                    "o-",
                    color=colour(i),
                    markersize=4,
                    label=run.label,
                )
                band = [wilson(r["success_rate"] * r["rollouts"], r["rollouts"]) for r in rows]
                ax.fill_between(
                    xs,
                    [lo for lo, _ in band],
                    [hi for _, hi in band],
                    color=colour(i),
                    alpha=0.18,
                    linewidth=0,
                )
        ax.set_title(
            f"held-out tasks ({heldout[0][0]['rollouts'] if heldout[0] else '…'} "
            "rollouts a version; band: 95 % interval)",
            fontsize=9,
        )
        panels.append((ax, None, "success_rate", "policy version", "held-out success rate"))
    for i, run in enumerate(runs):
        by_steps = query_rows(run.con, _CURVE_BY_STEPS)
        by_version = query_rows(run.con, PER_VERSION)
        for ax, x, y, _, _ in panels:
            if x is None:  # the held-out panel, drawn above
                continue
            rows = by_steps if x == "env_steps" else by_version
            curve(ax, [r[x] for r in rows], [r[y] for r in rows], colour(i), run.label)
    for ax, _, y, xlabel, ylabel in panels:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        integer_ticks(ax)
        if y == "success_rate":
            ax.set_ylim(-0.03, 1.03)
        legend(ax, runs)
    fig.suptitle("Learning curves (line: moving average; dots: per point)")
    return save(fig, path)


def plot_episodes(runs: list[Run], path: Path) -> bool:
    fig, axes = figure(1, 2)
    for i, run in enumerate(runs):
        rows = query_rows(run.con, PER_VERSION)
        versions = [r["version"] for r in rows]
        curve(axes[0][0], versions, [r["invalid_rate"] for r in rows], colour(i), run.label)
        curve(axes[0][1], versions, [r["episode_length"] for r in rows], colour(i), run.label)
    for ax, label in zip(axes[0], ["invalid-action rate", "episode length (turns)"], strict=True):
        ax.set_xlabel("policy version")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        integer_ticks(ax)
        legend(ax, runs)
    axes[0][0].set_ylim(-0.03, 1.03)
    axes[0][1].set_ylim(bottom=0)
    fig.suptitle("Episodes per policy version")
    return save(fig, path)


# --- advantages ----------------------------------------------------------------------
def _estimator_series(runs: list[Run]) -> list[tuple[Run, str, str]]:
    """(run, estimator tag, legend label) for every estimator of every run."""
    out = []
    for run in runs:
        for row in query_rows(run.con, "SELECT estimator, name FROM estimators ORDER BY estimator"):
            out.append((run, row["estimator"], row["name"] or row["estimator"]))
    names = [name for _, _, name in out]
    labelled = []
    for run, tag, name in out:
        label = name if names.count(name) == 1 else tag
        labelled.append((run, tag, label if len(runs) == 1 else f"{run.label} · {label}"))
    return labelled


def plot_advantages(runs: list[Run], path: Path) -> bool:
    import numpy as np

    series = _estimator_series(runs)
    # Shared bins: the 0.5–99.5 % range over every estimator of every run.
    bounds = [
        query_rows(
            run.con,
            "SELECT quantile_cont(advantage, 0.005) AS lo, "
            "quantile_cont(advantage, 0.995) AS hi FROM advantages",
        )[0]
        for run in runs
    ]
    lo = min(b["lo"] for b in bounds if b["lo"] is not None)
    hi = max(b["hi"] for b in bounds if b["hi"] is not None)
    if not hi > lo:
        lo, hi = lo - 1.0, hi + 1.0
    edges = np.linspace(lo, hi, BINS + 1)
    fig, axes = figure(1, 2, width=5.6, height=3.6)
    hist_ax, turn_ax = axes[0]
    for i, (run, tag, label) in enumerate(series):
        counts = np.zeros(BINS)
        for r in query_rows(
            run.con,
            f"""SELECT greatest(0, least({BINS - 1},
                   floor((advantage - ?) / (? - ?) * {BINS})))::INT AS bin, count(*) AS n
                FROM advantages WHERE estimator = ? GROUP BY ALL""",
            [lo, hi, lo, tag],
        ):
            counts[r["bin"]] = r["n"]
        hist_ax.stairs(counts, edges, color=colour(i), linewidth=1.5, label=label)
        by_turn = query_rows(
            run.con,
            "SELECT step, avg(advantage) AS mean, stddev_pop(advantage) AS std FROM advantages "
            f"WHERE estimator = ? AND step < {MAX_TURNS_BY_TURN} GROUP BY step ORDER BY step",
            [tag],
        )
        steps = np.array([r["step"] for r in by_turn])
        mean = np.array([r["mean"] for r in by_turn], dtype=float)
        std = np.array([r["std"] or 0.0 for r in by_turn], dtype=float)
        turn_ax.plot(steps, mean, "-o", color=colour(i), markersize=3, label=label)
        turn_ax.fill_between(steps, mean - std, mean + std, color=colour(i), alpha=0.12)
    hist_ax.set_yscale("log")
    hist_ax.set_xlabel("advantage (shared bins; outliers in the edge bins)")
    hist_ax.set_ylabel("steps (log scale)")
    hist_ax.grid(alpha=0.3)
    hist_ax.legend(fontsize=7, frameon=False)
    turn_ax.axhline(0, color="grey", linewidth=0.8)
    turn_ax.set_xlabel("turn")
    turn_ax.set_ylabel("advantage: mean ± std over steps")
    turn_ax.grid(alpha=0.3)
    integer_ticks(turn_ax)
    turn_ax.legend(fontsize=7, frameon=False)
    fig.suptitle("Advantages per estimator")
    return save(fig, path)


_SCATTER = f"""
SELECT "return", value_proxy FROM advantages WHERE estimator = ?
ORDER BY hash(traj_id, step) LIMIT {SCATTER_POINTS}
"""


def plot_value_proxy(runs: list[Run], path: Path) -> bool:
    import numpy as np

    series = _estimator_series(runs)[:6]
    cols = min(3, len(series))
    fig, axes = figure(math.ceil(len(series) / cols), cols, width=max(3.6, 7.2 / cols), height=3.6)
    points = [query_rows(run.con, _SCATTER, [tag]) for run, tag, _ in series]
    values = [v for rows in points for r in rows for v in (r["return"], r["value_proxy"])]
    lo, hi = min(values), max(values)
    pad = 0.05 * (hi - lo or 1.0)
    for k, ((_, _, label), rows) in enumerate(zip(series, points, strict=True)):
        ax = axes[k // cols][k % cols]
        g = np.array([r["return"] for r in rows], dtype=float)
        v = np.array([r["value_proxy"] for r in rows], dtype=float)
        ax.scatter(g, v, s=6, alpha=0.3, color=colour(k), linewidths=0)
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="grey", linewidth=0.8)
        corr = (
            np.corrcoef(g, v)[0, 1] if len(g) > 1 and g.std() > 0 and v.std() > 0 else float("nan")
        )
        ax.set_title(f"{label}\ncorr {corr:.2f}, {len(g)} steps", fontsize=8)
        ax.set_xlim(lo - pad, hi + pad)
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_xlabel("realised return-to-go G_t")
        ax.set_ylabel("value proxy V̂(s_t)")
        ax.grid(alpha=0.3)
    for j in range(len(series), len(axes) * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle("Value proxy against realised return-to-go (grey: V̂ = G)")
    return save(fig, path)


# --- singleton states ----------------------------------------------------------------
_SINGLETON_BY_STEPS = f"""
WITH per_shard AS (
    SELECT shard_id, min(started_at) AS started, sum(steps) AS steps,
           sum(singleton_states) AS singletons
    FROM groups GROUP BY shard_id
), binned AS (
    SELECT *, ntile({CURVE_POINTS}) OVER (ORDER BY started, shard_id) AS bin FROM per_shard
), points AS (
    SELECT bin, sum(steps) AS steps, sum(singletons) / sum(steps) AS singleton_rate
    FROM binned GROUP BY bin
)
SELECT sum(steps) OVER (ORDER BY bin) AS env_steps, singleton_rate FROM points ORDER BY bin
"""


def plot_singletons(runs: list[Run], path: Path) -> bool:
    fig, axes = figure(1, 2)
    for i, run in enumerate(runs):
        by_steps = query_rows(run.con, _SINGLETON_BY_STEPS)
        by_version = query_rows(
            run.con,
            "SELECT policy_version AS version, sum(singleton_states) / sum(steps) AS singleton_rate "
            "FROM groups GROUP BY policy_version ORDER BY policy_version",
        )
        for ax, rows, x in [
            (axes[0][0], by_version, "version"),
            (axes[0][1], by_steps, "env_steps"),
        ]:
            curve(
                ax, [r[x] for r in rows], [r["singleton_rate"] for r in rows], colour(i), run.label
            )
    for ax, label in zip(axes[0], ["policy version", "environment steps"], strict=True):
        ax.set_xlabel(label)
        ax.set_ylabel("singleton-state rate")
        integer_ticks(ax)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        legend(ax, runs)
    fig.suptitle("Steps whose state occurs once in their group")
    return save(fig, path)


# --- learner -------------------------------------------------------------------------
_HISTOGRAM_TOTALS = """
SELECT bin, any_value(low) AS low, any_value(high) AS high, sum(count) AS count
FROM learner_histograms WHERE name = ? GROUP BY bin ORDER BY bin
"""
# (columns, y label, log scale) per panel; a panel with no value in any run says so.
_LEARNER_PANELS = [
    (["loss"], "loss", False),
    (["entropy"], "entropy (NULL: bonus off)", False),
    (["grad_norm"], "gradient norm", True),
    (["lr"], "learning rate", False),
    (["tokens_per_s"], "tokens / s", False),
    (["staleness_mean", "staleness_max"], "staleness (versions)", False),
    (["behavior_weight_mean", "behavior_weight_max"], "behaviour weight w", False),
    (["mismatch_kl"], "behaviour/learner mismatch (KL)", True),
]


def plot_learner(runs: list[Run], path: Path) -> bool:
    fig, axes = figure(3, 3, width=4.2, height=2.9)
    flat = [ax for row in axes for ax in row]
    metrics = [
        query_rows(run.con, 'SELECT * FROM learner_metrics ORDER BY "update"') for run in runs
    ]
    updates = [r["update"] for rows in metrics for r in rows]
    for ax, (columns, label, log) in zip(flat, _LEARNER_PANELS, strict=False):
        drawn = False
        for i, (run, rows) in enumerate(zip(runs, metrics, strict=True)):
            for k, column in enumerate(columns):
                ys = [r.get(column) for r in rows]
                tag = run.label if len(columns) == 1 else f"{run.label} {column.rsplit('_', 1)[1]}"
                if k:  # the max of a mean/max pair: dashed, no raw points
                    pts = [(r["update"], y) for r, y in zip(rows, ys, strict=True) if finite(y)]
                    if pts:
                        ax.plot(
                            *zip(*pts, strict=True),
                            "--",
                            color=colour(i),
                            linewidth=1,
                            label=tag if len(runs) > 1 or len(columns) > 1 else None,
                        )
                    continue
                drawn |= curve(
                    ax,
                    [r["update"] for r in rows],
                    ys,
                    colour(i),
                    tag if len(runs) > 1 or len(columns) > 1 else None,
                )
        if not drawn:
            empty(ax, "not computed at these settings")
            ax.set_xticks([])
            ax.set_yticks([])
        elif log and all(
            y > 0 for rows in metrics for r in rows for y in [r.get(columns[0])] if finite(y)
        ):
            ax.set_yscale("log")
        if updates:  # every panel on the same update axis
            ax.set_xlim(min(updates) - 0.5, max(updates) + 0.5)
        ax.set_xlabel("update")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
        integer_ticks(ax)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, frameon=False)
    _behaviour_weight_histogram(flat[len(_LEARNER_PANELS)], runs, metrics)
    fig.suptitle("Learner per update (line: moving average; dots: per update)")
    return save(fig, path)


def _behaviour_weight_histogram(ax, runs: list[Run], metrics: list[list[dict]]) -> None:
    """Behaviour weights over all updates, the axis fitted to the bins that hold data."""
    lows, highs, drawn = [], [], False
    for i, run in enumerate(runs):
        bins = query_rows(run.con, _HISTOGRAM_TOTALS, ["behavior_weight"])
        used = [b for b in bins if b["count"] and b["low"] is not None and b["high"] is not None]
        if used:
            ax.stairs(
                [b["count"] for b in bins],
                [bins[0]["low"]] + [b["high"] for b in bins],
                color=colour(i),
                label=run.label if len(runs) > 1 else None,
            )
            lows.append(used[0]["low"])
            highs.append(used[-1]["high"])
            drawn = True
        else:  # no histograms: the per-update means
            values = [
                r["behavior_weight_mean"]
                for r in metrics[i]
                if finite(r.get("behavior_weight_mean"))
            ]
            if values:
                ax.hist(values, bins=20, histtype="step", color=colour(i))
                lows.append(min(values))
                highs.append(max(values))
                drawn = True
    if not drawn:
        empty(ax)
        return
    lo, hi = min(lows), max(highs)
    pad = 0.1 * (hi - lo or 0.1)
    ax.set_xlim(lo - pad, hi + pad)
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("behaviour weight w (all updates)")
    ax.set_ylabel("actions", fontsize=8)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, frameon=False)

"""The paper's three analyses in `gagpo report`, for one run or several side by side
(issue 45), each a table for summary.md and a figure, read through the SQL views:

1. Early learning (`early_learning.png`): the success rate of the rollouts against the
   environment steps consumed so far. Shards are taken in commit order (first step time,
   then id) and each is placed at the cumulative number of steps up to and including it.
2. Interaction efficiency (`interaction_efficiency.png`): environment steps per
   successful episode over training, i.e. every step played in a window of environment
   steps divided by the successes in it (what one success costs in interaction), and the
   mean length of the successful episodes alone (how directly a success is reached).
3. Smoothness (`smoothness.png`): the update-to-update variation of the learner's loss,
   gradient norm and KL estimates: the absolute first difference |x_u − x_{u−1}| between
   consecutive recorded updates, its mean, standard deviation (population) and maximum.
   The KLs are `approx_kl` (π_prox against π_θ inside the update; 0 by construction with
   one mini-batch and no bypass), `kl_ref` (to the reference policy, when its coefficient is
   set) and `mismatch_kl` (behaviour policy against the learner); a metric never recorded
   is left out.

Windows: the tables cut the environment steps into `WINDOWS` equal windows of a budget
E, the least total among the runs compared (a single run: its own total), so every run is
read at the same budget and a longer run's tail is left out of the tables. A shard whose
cumulative steps s satisfy (w·E/K, (w+1)·E/K] falls in window w. The figures use
`PLOT_WINDOWS` windows of the same kind and follow each run to its own end.
"""

from __future__ import annotations

from pathlib import Path

from gagpo.inspection.intervals import wilson
from gagpo.inspection.report_base import (
    Run,
    colour,
    curve,
    figure,
    integer_ticks,
    legend,
    markdown_table,
    query_rows,
    query_scalar,
    save,
)

WINDOWS = 5  # windows of environment steps in the tables
PLOT_WINDOWS = 20  # and in the figures
# (learner_metrics column, what it is) for the smoothness analysis, in table order
SMOOTHNESS_METRICS = (
    ("loss", "loss"),
    ("grad_norm", "gradient norm"),
    ("approx_kl", "KL(π_prox, π_θ) (approx_kl)"),
    ("kl_ref", "KL to the reference (kl_ref)"),
    ("mismatch_kl", "behaviour/learner KL (mismatch_kl)"),
)

# One row per window w of width E/K (parameters K, E and the last cumulative step count
# admitted): rollouts, successes, steps and the steps of successful rollouts.
_WINDOWS = """
WITH per_shard AS (
    SELECT shard_id, min(started_at) AS started, sum(length) AS steps,
           count(*) AS episodes, count(*) FILTER (WHERE success) AS successes,
           coalesce(sum(length) FILTER (WHERE success), 0) AS success_steps
    FROM trajectories GROUP BY shard_id
), placed AS (
    SELECT *, sum(steps) OVER (ORDER BY started, shard_id ROWS UNBOUNDED PRECEDING)
                  AS env_steps
    FROM per_shard
)
SELECT ((env_steps * ? - 1) // ?)::BIGINT AS "window",
       sum(episodes)::BIGINT AS episodes, sum(successes)::BIGINT AS successes,
       sum(steps)::BIGINT AS steps, sum(success_steps)::BIGINT AS success_steps
FROM placed WHERE env_steps <= ? GROUP BY ALL ORDER BY "window"
"""

# |x_u − x_{u−1}| over consecutive updates that recorded a finite value; {column} is one
# of SMOOTHNESS_METRICS' names, never user text.
_DIFFS = """
WITH v AS (
    SELECT "update", {column}::DOUBLE AS value FROM learner_metrics
    WHERE isfinite({column}::DOUBLE)
)
SELECT "update", value, abs(value - lag(value) OVER (ORDER BY "update")) AS abs_diff FROM v
ORDER BY "update"
"""
_SMOOTHNESS = f"""
WITH d AS ({_DIFFS})
SELECT count(*) AS updates, avg(value) AS mean, avg(abs_diff) AS mean_abs_diff,
       stddev_pop(abs_diff) AS std_abs_diff, max(abs_diff) AS max_abs_diff
FROM d
"""


def env_steps_total(run: Run) -> int:
    """Every environment step the run's rollouts played."""
    return int(query_scalar(run.con, "SELECT coalesce(sum(length), 0) FROM trajectories"))


def budget(runs: list[Run]) -> int:
    """E: the least total of environment steps among the runs that have any (0: none)."""
    totals = [env_steps_total(run) for run in runs]
    return min((t for t in totals if t > 0), default=0)


def windows(run: Run, k: int, e: int, until: int | None = None) -> list[dict]:
    """The run's windows of width e/k with data, shards up to `until` cumulative steps
    (default e): window, end (its last environment step, e·(w+1)/k), episodes,
    successes, success_rate, steps, steps_per_success, success_length."""
    limit = e if until is None else until
    rows = query_rows(run.con, _WINDOWS, [k, e, limit])
    for row in rows:
        row["end"] = e * (row["window"] + 1) / k
        wins = row["successes"]
        row["success_rate"] = wins / row["episodes"]
        row["steps_per_success"] = row["steps"] / wins if wins else None
        row["success_length"] = row["success_steps"] / wins if wins else None
    return rows


def smoothness_rows(run: Run) -> list[dict]:
    """Per recorded metric: updates, mean, mean/std/max of |first difference|."""
    rows = []
    for column, _ in SMOOTHNESS_METRICS:
        row = query_rows(run.con, _SMOOTHNESS.format(column=column))[0]
        if row["updates"]:
            rows.append({"run": run.label, "metric": column, **row})
    return rows


# --- summary.md ----------------------------------------------------------------------
def _wide(runs: list[Run], per_run: dict[str, list[dict]], e: int, cells) -> list[dict]:
    """One row per window of the budget, `cells(label, row or None)` columns per run."""
    out = []
    for w in range(WINDOWS):
        line = {"env steps ≤": round(e * (w + 1) / WINDOWS)}
        for run in runs:
            row = next((r for r in per_run[run.label] if r["window"] == w), None)
            line |= cells(run.label, row)
        out.append(line)
    total = {"env steps ≤": f"all ≤ {e}"}
    for run in runs:
        rows = per_run[run.label]
        whole = {k: sum(r[k] for r in rows) for k in ("episodes", "successes", "steps")}
        whole["success_steps"] = sum(r["success_steps"] for r in rows)
        wins = whole["successes"]
        whole["success_rate"] = wins / whole["episodes"] if whole["episodes"] else None
        whole["steps_per_success"] = whole["steps"] / wins if wins else None
        whole["success_length"] = whole["success_steps"] / wins if wins else None
        total |= cells(run.label, whole if rows else None)
    return [*out, total]


def _success_cells(label: str, row: dict | None) -> dict:
    return {
        f"{label} success": row["success_rate"] if row else None,
        f"{label} episodes": row["episodes"] if row else 0,
    }


def _efficiency_cells(label: str, row: dict | None) -> dict:
    return {
        f"{label} steps/success": row["steps_per_success"] if row else None,
        f"{label} success length": row["success_length"] if row else None,
    }


def analyses_section(runs: list[Run]) -> list[str]:
    """The three analyses as Markdown: what each measures, and its table."""
    lines = ["", "## The paper's three analyses", ""]
    stepped = [run for run in runs if run.has_steps]
    e = budget(stepped)
    if e:
        per_run = {run.label: windows(run, WINDOWS, e) for run in stepped}
        success = _wide(stepped, per_run, e, _success_cells)
        efficiency = _wide(stepped, per_run, e, _efficiency_cells)
        lines += [
            "### Early learning: success against environment steps",
            "",
            f"Rollouts' success rate in {WINDOWS} equal windows of the first {e} environment "
            "steps (the least total among the runs), shards in commit order; episodes: "
            "rollouts in the window.",
            "",
            *markdown_table(success, list(success[0])),
            "",
            "### Interaction efficiency: steps per successful episode",
            "",
            "steps/success: environment steps played in the window per successful rollout "
            "in it (lower: fewer interactions per success); success length: mean steps of "
            "the successful rollouts alone.",
            "",
            *markdown_table(efficiency, list(efficiency[0])),
        ]
    else:
        lines += ["No environment steps yet: no early-learning or efficiency table.", ""]
    smooth = [row for run in runs if run.has_learner for row in smoothness_rows(run)]
    lines += ["", "### Smoothness: update-to-update variation", ""]
    if smooth:
        lines += [
            "The absolute change |Δ| of a learner metric from one recorded update to the "
            "next: its mean, population std and max over the run's updates (lower: smoother).",
            "",
            *markdown_table(smooth, list(smooth[0])),
        ]
    else:
        lines.append("No learner metrics yet.")
    return lines


# --- figures -------------------------------------------------------------------------
def _axes_style(ax, runs: list[Run], xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(alpha=0.3)
    integer_ticks(ax)
    legend(ax, runs)


def plot_early_learning(runs: list[Run], path: Path) -> bool:
    e = budget(runs)
    if not e:
        return False
    fig, axes = figure(1, 1, width=6.4, height=3.8)
    ax = axes[0][0]
    for i, run in enumerate(runs):
        rows = windows(run, PLOT_WINDOWS, e, until=env_steps_total(run))
        xs = [r["end"] for r in rows]
        ax.plot(xs, [r["success_rate"] for r in rows], "o-", color=colour(i), label=run.label)
        band = [wilson(r["successes"], r["episodes"]) for r in rows]
        ax.fill_between(
            xs, [lo for lo, _ in band], [hi for _, hi in band], color=colour(i), alpha=0.15
        )
    if len(runs) > 1:
        ax.axvline(e, color="grey", linestyle="--", linewidth=0.8)
    ax.set_ylim(-0.03, 1.03)
    _axes_style(ax, runs, "environment steps consumed", "success rate (band: 95 % interval)")
    fig.suptitle(f"Early learning: success per window of {e / PLOT_WINDOWS:.0f} steps")
    return save(fig, path)


def plot_interaction_efficiency(runs: list[Run], path: Path) -> bool:
    e = budget(runs)
    if not e:
        return False
    fig, axes = figure(1, 2)
    for i, run in enumerate(runs):
        rows = windows(run, PLOT_WINDOWS, e, until=env_steps_total(run))
        xs = [r["end"] for r in rows]
        for ax, key in zip(axes[0], ("steps_per_success", "success_length"), strict=True):
            pts = [(x, r[key]) for x, r in zip(xs, rows, strict=True) if r[key] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", color=colour(i), label=run.label)
    labels = ("environment steps per success", "steps of a successful episode")
    for ax, label in zip(axes[0], labels, strict=True):
        ax.set_ylim(bottom=0)
        _axes_style(ax, runs, "environment steps consumed", label)
    fig.suptitle("Interaction efficiency over training (windows without a success: no point)")
    return save(fig, path)


def plot_smoothness(runs: list[Run], path: Path) -> bool:
    stats = {run.label: {r["metric"]: r for r in smoothness_rows(run)} for run in runs}
    shown = [(c, name) for c, name in SMOOTHNESS_METRICS if any(c in s for s in stats.values())]
    if not shown:
        return False
    fig, axes = figure(1, len(shown), width=4.2, height=3.2)
    for ax, (column, name) in zip(axes[0], shown, strict=True):
        for i, run in enumerate(runs):
            row = stats[run.label].get(column)
            if row is None or row["mean_abs_diff"] is None:
                continue
            diffs = query_rows(run.con, _DIFFS.format(column=column))[1:]
            tag = f"{run.label}: {row['mean_abs_diff']:.3g} ± {row['std_abs_diff']:.2g}"
            curve(ax, [d["update"] for d in diffs], [d["abs_diff"] for d in diffs], colour(i), tag)
        ax.set_title(name, fontsize=8)
        _axes_style(ax, runs, "update", "|Δ| from the previous update")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, frameon=False, title="mean ± std", title_fontsize=6)
    fig.suptitle("Smoothness: update-to-update change (line: moving average)")
    return save(fig, path)

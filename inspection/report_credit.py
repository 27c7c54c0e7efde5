"""The credit heat map of `gagpo report`: chosen rollouts turn by turn, (state, action) ×
reward, value proxy, TD residual and the advantages of up to four estimator tags, on one
colour scale."""

from __future__ import annotations

import os
from pathlib import Path

from gagpo.inspection.report_base import Run, query_rows, query_scalar
from gagpo.schemas.errors import GagpoError

MAX_HEATMAP_TRAJS = 4
MAX_HEATMAP_ESTIMATORS = 4
ANNOTATE_MAX_TURNS = 25
LABEL_CHARS = 34  # state / action text shown per heat-map row


def _primary_estimator(con) -> str:
    """The tag shown first: a GAGPO one where there is one."""
    tags = query_rows(con, "SELECT estimator, name FROM estimators ORDER BY estimator")
    names = [(row["name"] or row["estimator"]).lower() for row in tags]
    for wanted in (lambda n: n == "gagpo", lambda n: n.startswith("gagpo")):
        for row, name in zip(tags, names, strict=True):
            if wanted(name):
                return row["estimator"]
    return tags[0]["estimator"]


def _short_names(con, tags: list[str]) -> dict[str, str]:
    """Estimator name for a tag where no other shown tag has the same name, else the tag."""
    names = {
        r["estimator"]: r["name"] or r["estimator"]
        for r in query_rows(con, "SELECT estimator, name FROM estimators")
    }
    shown = [names[tag] for tag in tags]
    return {tag: names[tag] if shown.count(names[tag]) == 1 else tag for tag in tags}


def _default_trajectories(con, tag: str) -> list[str]:
    """Best and worst rollout of the group (with advantages) whose returns differ most."""
    rows = query_rows(
        con,
        """
        WITH covered AS (SELECT DISTINCT group_id FROM advantages WHERE estimator = ?)
        SELECT t.traj_id, t."return", t.group_id
        FROM trajectories t JOIN covered USING (group_id)
        WHERE t.group_id = (
            SELECT g.group_id FROM groups g JOIN covered USING (group_id)
            ORDER BY g.max_return - g.min_return DESC, g.group_id LIMIT 1)
        ORDER BY t."return" DESC, t.traj_id
        """,
        [tag],
    )
    if not rows:
        return []
    chosen = [rows[0]["traj_id"]]
    if len(rows) > 1:
        chosen.append(rows[-1]["traj_id"])
    return chosen


def _clip_text(text: str | None, n: int = LABEL_CHARS) -> str:
    text = " ".join(str(text or "").split())
    text = text if len(text) <= n else text[: n - 1] + "…"
    return text.replace("$", r"\$")  # environment text, not mathtext


def _turn_labels(rollouts: list[list[tuple]]) -> list[list[str]]:
    """`turn: action | sK state` per row. States are numbered in order of first visit over
    all rollouts shown (equal numbers: the same state, pooled by the value proxy), and the
    text shown starts where the states begin to differ."""
    states = list(dict.fromkeys(state for rows in rollouts for _, state, _, _ in rows))
    number = {state: k for k, state in enumerate(states)}
    prefix = len(os.path.commonprefix(states)) if len(states) > 1 else 0  # noqa: RUF071 (text)
    return [
        [
            f"{turn}: {_clip_text(action, 18)}{'' if valid else ' ✗'} | "
            f"s{number[state]} {_clip_text(state[prefix:], 24)}"
            for turn, state, action, valid in rows
        ]
        for rows in rollouts
    ]


_ROLLOUT = """
SELECT s.step, s.reward::DOUBLE AS reward, s.state_key, s.action_text,
       s.action_valid, a.estimator, a.value_proxy, a.td_residual, a.advantage
FROM steps s
LEFT JOIN advantages a ON a.traj_id = s.traj_id AND a.step = s.step
     AND list_contains(?, a.estimator)
WHERE s.traj_id = ? ORDER BY s.step
"""


def _holder(runs: list[Run], traj_ids: list[str]) -> Run:
    """The first run holding the first chosen rollout (none chosen: the first run)."""
    if not traj_ids:
        return runs[0]
    query = "SELECT count(*) FROM steps WHERE traj_id = ?"
    holders = [r for r in runs if query_scalar(r.con, query, [traj_ids[0]])]
    if not holders:
        raise GagpoError(
            f"--traj {traj_ids[0]!r} is not in the store; accepted: a traj_id of steps"
        )
    return holders[0]


def _tags_and_rollouts(con, traj_ids: list[str]) -> tuple[list[str], list[str]]:
    """The estimator tags shown (the primary first) and the rollouts, every one checked."""
    primary = _primary_estimator(con)
    others = [
        r["estimator"]
        for r in query_rows(con, "SELECT estimator FROM estimators ORDER BY estimator")
        if r["estimator"] != primary
    ]
    tags = [primary, *others[: MAX_HEATMAP_ESTIMATORS - 1]]
    chosen = traj_ids or _default_trajectories(con, primary)
    known = {
        r["traj_id"]
        for r in query_rows(
            con, "SELECT DISTINCT traj_id FROM steps WHERE list_contains(?, traj_id)", [chosen]
        )
    }
    missing = [t for t in chosen if t not in known]
    if missing:
        raise GagpoError(f"--traj {missing[0]!r} is not in the store; accepted: a traj_id of steps")
    return tags, chosen[:MAX_HEATMAP_TRAJS]


def _rollout_grid(con, traj: str, tags: list[str], width: int):
    """One rollout: a turns × columns grid (reward, V̂ and δ of the primary tag, Â per
    tag), its (turn, state, action, valid) rows and its title."""
    import numpy as np

    rows = query_rows(con, _ROLLOUT, [tags, traj])
    turns = sorted({r["step"] for r in rows})
    grid = np.full((len(turns), width), np.nan)
    text = {}
    for r in rows:
        t = turns.index(r["step"])
        grid[t, 0] = r["reward"]
        text[t] = (r["state_key"], r["action_text"], r["action_valid"])
        if r["estimator"] == tags[0]:
            grid[t, 1], grid[t, 2] = r["value_proxy"], r["td_residual"]
        if r["estimator"] in tags:
            grid[t, 3 + tags.index(r["estimator"])] = r["advantage"]
    success = query_scalar(con, "SELECT success FROM trajectories WHERE traj_id = ?", [traj])
    ret = query_scalar(con, 'SELECT "return" FROM trajectories WHERE traj_id = ?', [traj])
    title = f"{traj} — {'success' if success else 'failure'}, return {ret:.3g}"
    return grid, [(turns[t], *text[t]) for t in range(len(turns))], title


def plot_credit_heatmap(runs: list[Run], path: Path, traj_ids: list[str]) -> bool:
    """The first run holding the chosen rollouts (default: the first with advantages)."""
    run = _holder(runs, traj_ids)
    tags, chosen = _tags_and_rollouts(run.con, traj_ids)
    if not chosen:
        return False
    short = _short_names(run.con, tags)
    columns = ["reward", f"V̂ {short[tags[0]]}", f"δ {short[tags[0]]}"]
    columns += [f"Â {short[tag]}" for tag in tags]
    grids, labels, titles = zip(
        *(_rollout_grid(run.con, traj, tags, len(columns)) for traj in chosen), strict=True
    )
    _draw_heatmap(list(grids), _turn_labels(list(labels)), list(titles), columns, run.label, path)
    return True


def _draw_heatmap(grids, labels, titles, columns, label: str, path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    # One colour scale for every cell: the largest |value| shown (rewards, values and
    # advantages are compared as they are, not rescaled per row).
    scale = max(float(np.nanmax(np.abs(g), initial=0.0)) for g in grids) or 1.0
    heights = [max(len(g), 1) for g in grids]
    fig, axes = plt.subplots(
        len(grids),
        1,
        figsize=(8.5, 1.3 + 0.28 * sum(heights) + 0.5 * len(grids)),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
        layout="constrained",
    )
    image = None
    for ax, grid, rows_text, title in zip((a[0] for a in axes), grids, labels, titles, strict=True):
        image = ax.imshow(
            grid, aspect="auto", cmap="RdBu", vmin=-scale, vmax=scale, interpolation="nearest"
        )
        ax.set_yticks(range(len(rows_text)), rows_text, fontsize=7, family="monospace")
        ax.set_xticks(range(len(columns)), columns, fontsize=7)
        ax.xaxis.tick_top()
        ax.set_title(title, fontsize=8, loc="left")
        if len(rows_text) <= ANNOTATE_MAX_TURNS:
            for (i, j), value in np.ndenumerate(grid):
                if not np.isnan(value):
                    colour = "white" if abs(value) > 0.6 * scale else "black"
                    ax.text(
                        j, i, f"{value:.2g}", ha="center", va="center", fontsize=6.5, color=colour
                    )
    fig.colorbar(image, ax=[a[0] for a in axes], shrink=0.8, pad=0.01, label="value (one scale)")
    fig.suptitle(
        f"Credit per turn ({label}) — row: turn: action | state (sK: K-th distinct "
        "state; ✗: invalid action)",
        fontsize=9,
    )
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)

"""The pools page of `gagpo view`: the state pools of each stored advantage tag.

It reads counts (each tag's steps per stored pool size) and the states and value proxies
of the pools it shows only: it never builds every pool's return statistics as the
`state_pools` view does (65 s on a compacted 16 k-group store; this, under 1 s).
"""

from __future__ import annotations

from typing import Any, Protocol


class StoreSession(Protocol):
    """What the page reads through (inspection/view/data.py's `StoreSession` is one)."""

    label: str

    def rows(self, sql: str, params: Any = None) -> list[dict]: ...


# Groups without stored advantages, pooled exactly (as `state_pools` does, estimator NULL).
UNSCORED = "steps ANTI JOIN (SELECT DISTINCT group_id FROM advantages) a USING (group_id)"


def pools_view(session: StoreSession, limit: int = 30) -> dict:
    """Per stored tag (and the exact pools of groups without advantages): pools, steps and
    the share of steps alone in their pool; the largest pools; pools that merged several
    distinct states (tags of another grouping than exact only).

    Read by counts, not pool by pool: each tag's steps per pool size (`state_group_size`,
    which the advantage stage stored with every step: an integer column, no state read)
    give its pools, steps and singletons, and the size the `limit`-th largest pool has;
    only steps in pools at least that large are then read with their states. Groups
    without advantages are pooled from `steps`, and only when no tag covers every step."""
    tags = session.rows(
        "SELECT estimator, coalesce(json_extract_string(params, "
        "'$.state_grouping'), 'exact') AS state_grouping FROM estimators "
        "ORDER BY estimator"
    )
    total = session.rows("SELECT count(*) AS n FROM steps")[0]["n"]
    modes, sizes = [], []  # sizes: (pool size, pools of that size) over every mode
    for tag in tags:
        by_size = session.rows(
            "SELECT state_group_size AS visits, count(*) AS steps FROM "
            "advantages WHERE estimator = ? GROUP BY visits",
            [tag["estimator"]],
        )
        counts = [(r["visits"], r["steps"] // r["visits"]) for r in by_size]
        modes.append({**tag, **_mode(counts)})
        sizes += counts
    unscored = not any(m["steps"] == total for m in modes)  # some group may lack advantages
    if unscored:
        by_size = session.rows(f"""
            SELECT visits, count(*) AS pools FROM (SELECT count(*) AS visits FROM {UNSCORED}
                                                   GROUP BY group_id, state_key)
            GROUP BY visits""")
        counts = [(r["visits"], r["pools"]) for r in by_size]
        if counts:
            modes.append({"estimator": None, "state_grouping": "exact", **_mode(counts)})
            sizes += counts
    least = _least_shown(sizes, limit)
    exact_groups = (
        f"UNION ALL SELECT NULL, group_id, state_key, state_key, NULL FROM {UNSCORED}"
        if unscored
        else ""
    )
    largest = session.rows(
        f"""
        SELECT estimator, group_id, pool_id, count(*) AS visits,
               count(DISTINCT state_key) AS states, any_value(value_proxy) AS value_proxy
        FROM (SELECT estimator, group_id, coalesce(pool_id, state_key) AS pool_id, state_key,
                     value_proxy
              FROM advantages WHERE state_group_size >= $least {exact_groups})
        GROUP BY estimator, group_id, pool_id HAVING count(*) >= $least
        ORDER BY visits DESC, estimator, group_id, pool_id LIMIT $limit
    """,
        {"least": least, "limit": int(limit)},
    )
    _fill_value_proxies(session, [r for r in largest if r["estimator"] is None])
    merging = [t["estimator"] for t in tags if t["state_grouping"] != "exact"]
    merged = []
    if merging:  # an exact tag's pool is one state: nothing to read
        merged = session.rows(
            """
            SELECT estimator, group_id, pool_id, list(DISTINCT state_key ORDER BY state_key)
                   AS states, count(*) AS visits
            FROM (SELECT estimator, group_id, coalesce(pool_id, state_key) AS pool_id, state_key
                  FROM advantages WHERE estimator = ANY(?) AND state_group_size > 1)
            GROUP BY estimator, group_id, pool_id HAVING count(DISTINCT state_key) > 1
            ORDER BY visits DESC, estimator, group_id, pool_id LIMIT ?
        """,
            [merging, int(limit)],
        )
        grouping = {t["estimator"]: t["state_grouping"] for t in tags}
        for row in merged:
            row["state_grouping"] = grouping[row["estimator"]]
    return {"store": session.label, "modes": modes, "largest": largest, "merged": merged}


def _mode(counts: list[tuple[int, int]]) -> dict:
    """Pools, steps and singleton share from (pool size, pools of that size) pairs."""
    steps = sum(size * pools for size, pools in counts)
    alone = sum(pools for size, pools in counts if size == 1)
    return {
        "pools": sum(pools for _, pools in counts),
        "steps": steps,
        "singleton_share": alone / steps if steps else None,
    }


def _least_shown(sizes: list[tuple[int, int]], limit: int) -> int:
    """The size of the `limit`-th largest pool (1 when there are fewer)."""
    seen = 0
    for size, pools in sorted(sizes, reverse=True):
        seen += pools
        if seen >= limit:
            return size
    return 1


def _fill_value_proxies(session: StoreSession, rows: list[dict]) -> None:
    """The value proxy of pools of groups without stored advantages (estimator NULL: exact
    pools, discounted at the session's γ), from `state_pools` for those groups only. Its
    returns are windows over each rollout, so the filter names the rollouts (DuckDB
    pushes a filter on a window's partition into the scan; one on group_id it cannot)."""
    if not rows:
        return
    groups = sorted({r["group_id"] for r in rows})
    trajs = [
        r["traj_id"]
        for r in session.rows(
            "SELECT DISTINCT traj_id FROM steps WHERE group_id = ANY(?)", [groups]
        )
    ]
    values = session.rows(
        """
        SELECT group_id, state_key, avg("return" ORDER BY traj_id, step) AS value_proxy
        FROM step_returns WHERE traj_id = ANY(?) GROUP BY group_id, state_key
    """,
        [trajs],
    )
    by_pool = {(v["group_id"], v["state_key"]): v["value_proxy"] for v in values}
    for row in rows:
        row["value_proxy"] = by_pool.get((row["group_id"], row["pool_id"]))

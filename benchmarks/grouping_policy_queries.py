"""Singleton share of WebShop states under a real policy's own search queries (issue 23).

bench_grouping's `webshop-queries` row simulates free-text queries (the expert's, a word
dropped, swapped or added). This script reads a store that actors wrote with a real
policy on `--env webshop` and measures the same share under the same modes, with
bench_grouping's functions: the share of steps after the first turn whose pool (within
their group) is that step alone.

An untrained policy's replies are mostly not commands, and an invalid reply leaves the
agent on the page it was on; on the search page that is one state shared by the whole
group, so those steps are never singletons whatever the grouping. The share over all
later steps therefore mixes two things; the script also prints it over the later steps
away from the search page (results, item and sub-pages: the states a query shapes), and
describes the rollouts: valid replies, valid searches, distinct queries per group,
success, and the share of those off-search steps whose exact pool holds the visits of
one rollout only (no singleton, yet no comparison between rollouts either).

    gagpo-actors --store /tmp/gq/store --env webshop --policy smollm2-135m \\
        --groups 6 --group-size 8 --max-turns 8 --seed 0 --temperature 1.0 \\
        --history-window 0 --threads 1
    python benchmarks/grouping_policy_queries.py --store /tmp/gq/store [--json out.json]

(benchmarks/RESULTS.md, "State grouping", has the warm-started policy's commands.) The
table's `steps` column counts the steps the share is over: those after the first turn.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import polars as pl

from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from gagpo.workflows import credit

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_grouping import MODES, advantages, singleton_share

SEARCH_PAGE = "search"  # WebShop's state key on its search page (envs/webshop.py)
COLUMNS = (*C.ADVANTAGE_INPUT_COLUMNS, C.ACTION_TEXT, C.ACTION_VALID, C.WON, C.ENV)


def read_steps(url: str) -> pl.DataFrame:
    """The store's committed WebShop steps, the columns the stage and the description read."""
    try:
        return credit.read_steps(Store(url), "webshop", COLUMNS)
    except GagpoError as exc:
        raise SystemExit(str(exc)) from None


def describe(steps: pl.DataFrame) -> dict[str, float]:
    """What the policy did: valid replies, its searches and their queries, success."""
    searches = steps.filter(
        (pl.col(C.STATE_KEY) == SEARCH_PAGE) & pl.col(C.ACTION_VALID)
    ).with_columns(pl.col(C.NEXT_STATE_KEY).str.extract(r"query='(.*)' page=").alias("query"))
    per_group = (
        steps.select(C.GROUP_ID)
        .unique()
        .join(
            searches.group_by(C.GROUP_ID).agg(
                pl.len().alias("searches"), pl.col("query").n_unique().alias("queries")
            ),
            on=C.GROUP_ID,
            how="left",
        )
        .fill_null(0)
    )
    rollouts = steps.group_by(C.TRAJ_ID).agg(pl.col(C.WON).any(), pl.len().alias("turns"))
    # An exact pool's rollouts: a step that is no singleton may still share its pool only
    # with its own rollout's other visits (invalid replies leave the page as it was).
    visitors = pl.col(C.TRAJ_ID).n_unique().over(C.GROUP_ID, C.STATE_KEY).alias("visitors")
    later = steps.with_columns(visitors).filter(pl.col(C.STEP) > 0)
    off = later.filter(pl.col(C.STATE_KEY) != SEARCH_PAGE)
    return {
        "steps": steps.height,
        "later_steps": later.height,
        "later_off_search": off.height,
        "off_search_exact_pool_of_one_rollout": float((off["visitors"] == 1).mean()),
        "groups": per_group.height,
        "rollouts": rollouts.height,
        "mean_turns": float(rollouts["turns"].mean()),
        "valid_share": float(steps[C.ACTION_VALID].mean()),
        "valid_searches": searches.height,
        "rollouts_that_searched": searches[C.TRAJ_ID].n_unique(),
        "queries_per_group": per_group["queries"].to_list(),
        "searches_per_group": per_group["searches"].to_list(),
        "success": float(rollouts[C.WON].mean()),
    }


def shares(steps: pl.DataFrame) -> dict[str, dict[str, float]]:
    """Per mode: the singleton share over later steps, and over later steps off the search page."""
    out = {}
    for mode in MODES:
        table = advantages(steps, mode)
        off = table.filter((pl.col(C.STEP) > 0) & (pl.col(C.STATE_KEY) != SEARCH_PAGE))
        out[mode] = {
            "later": singleton_share(steps, table),
            "off_search": float((off[C.STATE_GROUP_SIZE] == 1).mean()) if off.height else 0.0,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="a store actors wrote on --env webshop")
    parser.add_argument("--label", default="webshop (policy's own queries)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    steps = read_steps(args.store)
    about, result = describe(steps), shares(steps)
    for name, value in about.items():
        print(f"{name}: {value}")
    print("\n| env | steps | " + " | ".join(MODES) + " |")
    print("|---|---|" + "---|" * len(MODES))
    for key, label, n in (
        ("later", args.label, about["later_steps"]),
        ("off_search", f"{args.label}, off the search page", about["later_off_search"]),
    ):
        cells = " | ".join(f"{100 * result[m][key]:.1f} %" for m in MODES)
        print(f"| {label} | {n} | {cells} |")
    if args.json:
        args.json.write_text(json.dumps({"rollouts": about, "shares": result}, indent=2))


if __name__ == "__main__":
    main()

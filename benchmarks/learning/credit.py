"""Credit assignment on identical data: does each estimator give Sokoban's optimal moves the
higher advantage?

Every estimator is recomputed (`gagpo.pipeline.compute_advantages`) on the *same* stored
rollouts, so the comparison has no sampling noise between methods: only the credit differs.
Each step's move is labelled against the exact solver (`sokoban.solve`, breadth-first):
*optimal* when it lies on a shortest solution from its state. Steps in states with no
solution left (a box stuck in a corner) or already solved carry no label and are left out.

Per estimator and store:
- AUC: the probability that an optimal move's advantage exceeds a non-optimal one's (ties
  count half; 0.5 = no credit, 1 = perfect ranking), from the ranks of all labelled steps;
- separation: (mean advantage of optimal moves − mean of the others) / std of all;
- IQR of the advantages (the paper's spread statistic, here on identical data).

    python benchmarks/learning/credit.py --stores benchmarks/learning/runs/sokoban/warm/gagpo/seed*
    python benchmarks/learning/credit.py --stores S1 S2 S3 --max-version 10 --markdown
"""

from __future__ import annotations

import argparse
import glob
from functools import cache
from pathlib import Path

import numpy as np
import polars as pl

from gagpo.actors.envs.sokoban import MOVES, parse_grid, push, render, solve
from gagpo.actors.prompts import parse_action
from gagpo.pipeline.advantages import compute_advantages
from gagpo.pipeline.config import parse_estimator_config
from gagpo.schemas import columns as C

ESTIMATORS = ("gagpo", "gagpo_lambda0", "gagpo_lambda1", "gigpo", "grpo", "rloo")
LABELS = {"gagpo": "GAGPO (λ=0.8)", "gagpo_lambda0": "GAGPO λ=0", "gagpo_lambda1": "GAGPO λ=1",
          "gigpo": "GiGPO", "grpo": "GRPO", "rloo": "RLOO"}  # fmt: skip
MAX_SOLUTION = 16  # moves; the benchmark's levels (3×3 floor, one box) need at most ~10


@cache
def moves_to_go(grid: str) -> int | None:
    """Length of a shortest solution from this grid (0: solved), or None: unsolvable."""
    plan = solve(parse_grid(grid), MAX_SOLUTION)
    return None if plan is None else len(plan)


@cache
def optimal_moves(grid: str) -> frozenset[str]:
    """The moves that start a shortest solution from this grid (empty if none is left)."""
    n = moves_to_go(grid)
    if not n:
        return frozenset()
    level = parse_grid(grid)
    return frozenset(m for m in MOVES if moves_to_go(render(push(level, m))) == n - 1)


def label(steps: pl.DataFrame) -> pl.DataFrame:
    """traj_id, step, policy_version and `optimal` (bool) for the labelled steps. The parser
    and the solver run once per distinct reply and per distinct state, not per step."""
    replies = steps.select(C.ACTION_TEXT).unique().with_columns(
        move=pl.col(C.ACTION_TEXT).map_elements(lambda t: parse_action(t, MOVES), pl.String))
    states = steps.select(C.STATE_KEY).unique().with_columns(
        best=pl.col(C.STATE_KEY).map_elements(lambda k: sorted(optimal_moves(k)), pl.List(pl.String)))  # fmt: skip
    return (
        steps.select(C.TRAJ_ID, C.STEP, C.POLICY_VERSION, C.STATE_KEY, C.ACTION_TEXT)
        .join(replies, on=C.ACTION_TEXT)
        .join(states, on=C.STATE_KEY)
        .filter(pl.col("best").list.len() > 0)  # solved or unsolvable states carry no label
        .select(C.TRAJ_ID, C.STEP, C.POLICY_VERSION,
                optimal=pl.col("best").list.contains(pl.col("move")).fill_null(False))
    )


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Mann–Whitney AUC of `scores` for `positive` against the rest (average ranks for ties)."""
    ranks = pl.Series(scores).rank("average").to_numpy()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if not n_pos or not n_neg:
        return float("nan")
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def credit(steps: pl.DataFrame, estimator: str) -> dict:
    """AUC, separation and IQR of `estimator`'s advantages on `steps` (one store's rows)."""
    config = parse_estimator_config({"estimator": estimator})
    adv = compute_advantages(steps.lazy().select(C.ADVANTAGE_INPUT_COLUMNS), config).collect()
    labelled = label(steps).join(adv.select(C.TRAJ_ID, C.STEP, C.ADVANTAGE), on=[C.TRAJ_ID, C.STEP])
    x = labelled[C.ADVANTAGE].to_numpy()
    y = labelled["optimal"].to_numpy()
    q1, q3 = np.quantile(adv[C.ADVANTAGE].to_numpy(), [0.25, 0.75])
    return {
        "auc": auc(x, y),
        "separation": float((x[y].mean() - x[~y].mean()) / x.std()) if x.std() > 0 else 0.0,
        "iqr": float(q3 - q1),
        "labelled_steps": len(x),
        "optimal_share": float(y.mean()),
    }


def read_steps(store: Path, max_version: int | None) -> pl.DataFrame:
    files = sorted(glob.glob(str(store / "shards" / "**" / "*.parquet"), recursive=True))
    if not files:
        raise SystemExit(f"credit: no shards under {store}/shards/; accepted: a store a run wrote")
    columns = [*C.ADVANTAGE_INPUT_COLUMNS, C.ACTION_TEXT, C.POLICY_VERSION, C.ENV]
    steps = pl.concat([pl.read_parquet(f, columns=columns, hive_partitioning=False) for f in files])
    if (steps[C.ENV] != "sokoban").any():
        raise SystemExit(f"credit: {store} holds non-Sokoban steps; only Sokoban has an exact solver here")
    return steps if max_version is None else steps.filter(pl.col(C.POLICY_VERSION) <= max_version)


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| estimator | stores | AUC (optimal vs other moves) | separation | advantage IQR |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, rows in results.items():
        cells = [f"{np.mean([r[k] for r in rows]):.3f} ± {np.std([r[k] for r in rows]):.3f}"
                 for k in ("auc", "separation", "iqr")]  # fmt: skip
        lines.append(f"| {LABELS.get(name, name)} | {len(rows)} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", nargs="+", type=Path, required=True, help="Sokoban run stores")
    parser.add_argument("--estimators", default=",".join(ESTIMATORS))
    parser.add_argument("--max-version", type=int, default=None,
                        help="use only rollouts of policy versions up to this one")  # fmt: skip
    args = parser.parse_args()
    results: dict[str, list[dict]] = {e: [] for e in args.estimators.split(",")}
    for store in args.stores:
        steps = read_steps(store, args.max_version)
        for name in results:
            r = credit(steps, name)
            results[name].append(r)
            print(f"{store}  {LABELS.get(name, name):14s}  AUC {r['auc']:.3f}  separation "
                  f"{r['separation']:.3f}  IQR {r['iqr']:.2f}  ({r['labelled_steps']} labelled steps, "
                  f"{r['optimal_share']:.0%} optimal)", flush=True)  # fmt: skip
    print()
    print(table(results))


if __name__ == "__main__":
    main()

"""Credit assignment on identical data: does each estimator give Sokoban's optimal moves the
higher advantage?

The oracle (solver labels, AUC) is the product's, `gagpo.workflows.credit`, which the demo
runs on its own store; this script compares the learning benchmark's stores with it.
Every estimator is recomputed (`gagpo.pipeline.compute_advantages`) on the *same* stored
rollouts, so the comparison has no sampling noise between methods: only the credit differs.
Each step's move is labelled against the exact solver (`sokoban.solve`, breadth-first):
*optimal* when it lies on a shortest solution from its state. Steps in states with no
solution left (a box stuck in a corner) or already solved carry no label and are left out.

Per estimator and store:
- AUC: the probability that an optimal move's advantage exceeds a non-optimal one's (ties
  count half; 0.5 = no credit, 1 = perfect ranking), from the ranks of all labelled steps;
- AUC within a state: the same over pairs of moves from one state of one group only;
- separation: (mean advantage of optimal moves − mean of the others) / std of all;
- IQR of the advantages (the paper's spread statistic, here on identical data).

    python benchmarks/learning/credit.py --stores benchmarks/learning/runs/sokoban/warm/gagpo/seed*
    python benchmarks/learning/credit.py --stores S1 S2 S3 --max-version 10 --markdown
"""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

import numpy as np
import polars as pl

from gagpo.pipeline.advantages import compute_advantages
from gagpo.pipeline.config import parse_estimator_config
from gagpo.schemas import columns as C
from gagpo.workflows.credit import auc, label, within_state_auc

ESTIMATORS = ("gagpo", "gagpo_lambda0", "gagpo_lambda1", "gigpo", "grpo", "rloo")
LABELS = {
    "gagpo": "GAGPO (λ=0.8)",
    "gagpo_lambda0": "GAGPO λ=0",
    "gagpo_lambda1": "GAGPO λ=1",
    "gigpo": "GiGPO",
    "grpo": "GRPO",
    "rloo": "RLOO",
}


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
        "state_auc": within_state_auc(labelled),
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
        raise SystemExit(
            f"credit: {store} holds non-Sokoban steps; only Sokoban has an exact solver here"
        )
    return steps if max_version is None else steps.filter(pl.col(C.POLICY_VERSION) <= max_version)


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| estimator | stores | AUC (optimal vs other moves) | AUC within a state | separation "
        "| advantage IQR |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        cells = [
            f"{np.mean([r[k] for r in rows]):.3f} ± {np.std([r[k] for r in rows]):.3f}"
            for k in ("auc", "state_auc", "separation", "iqr")
        ]
        lines.append(f"| {LABELS.get(name, name)} | {len(rows)} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", nargs="+", type=Path, required=True, help="Sokoban run stores")
    parser.add_argument("--estimators", default=",".join(ESTIMATORS))
    parser.add_argument(
        "--max-version",
        type=int,
        default=None,
        help="use only rollouts of policy versions up to this one",
    )
    args = parser.parse_args()
    results: dict[str, list[dict]] = {e: [] for e in args.estimators.split(",")}
    for store in args.stores:
        steps = read_steps(store, args.max_version)
        for name in results:
            r = credit(steps, name)
            results[name].append(r)
            print(
                f"{store}  {LABELS.get(name, name):14s}  AUC {r['auc']:.3f}  separation "
                f"{r['separation']:.3f}  IQR {r['iqr']:.2f}  ({r['labelled_steps']} labelled steps, "
                f"{r['optimal_share']:.0%} optimal)",
                flush=True,
            )
    print()
    print(table(results))


if __name__ == "__main__":
    main()

"""Does a decaying learning rate keep what was learned? Held-out success of the demo's
estimator under two `learner.lr_schedule` arms, read from run_learning.py's cells.

    python benchmarks/learning/stability.py            # runs/stability/<arm>/sokoban/warm/gagpo/seed*

It also draws benchmarks/learning/stability_sokoban.png: held-out success per version, each
arm's mean with its min–max band over seeds.

Per arm and seed: held-out success at every evaluated version (the same 64 tasks × 8
rollouts), the last version's, its gain over v0, the largest fall from one evaluated version
to the next, how far the last version sits below the best one, and the spread (std) of the
versions after the first ~third of the run (where learning has levelled off). Mean ± std
over seeds in the closing table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def arm_rows(root: Path, arm: str) -> list[dict]:
    rows = []
    for done in sorted((root / arm).glob("sokoban/warm/gagpo/seed*/result.json")):
        held = json.loads(done.read_text())["heldout"]
        rate = np.array(held["success"]) * 100
        late = rate[len(rate) // 3 + 1 :]
        rows.append(
            {
                "seed": done.parent.name,
                "versions": held["versions"],
                "rate": rate,
                "last": rate[-1],
                "gain": rate[-1] - rate[0],
                "worst_fall": float(np.max(np.maximum(rate[:-1] - rate[1:], 0))),
                "below_best": float(rate.max() - rate[-1]),
                "late_std": float(late.std()),
            }
        )
    return rows


def _mean_std(values: list[float]) -> str:
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}"


def plot(arms: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, (arm, rows) in enumerate(arms.items()):
        rates = np.array([r["rate"] for r in rows])
        versions = rows[0]["versions"]
        colour = plt.get_cmap("tab10")(i)
        ax.plot(versions, rates.mean(0), "o-", color=colour, label=f"{arm} ({len(rows)} seeds)")
        ax.fill_between(versions, rates.min(0), rates.max(0), color=colour, alpha=0.2)
    ax.set_xlabel("policy version (update)")
    ax.set_ylabel("held-out success (%)")
    ax.set_title(
        "demo recipe, GAGPO: learning-rate schedule (mean, min–max over seeds)", fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=HERE / "runs" / "stability")
    parser.add_argument("--arms", default="constant,cosine")
    parser.add_argument("--plot", type=Path, default=HERE / "stability_sokoban.png")
    args = parser.parse_args()
    arms = {}
    table = [
        "| lr_schedule | seeds | held-out v0 | last version | gain | worst fall between "
        "evaluated versions | last below best | spread of later versions (std) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in args.arms.split(","):
        rows = arm_rows(args.runs, arm)
        if not rows:
            print(f"{arm}: no finished cell under {args.runs / arm}")
            continue
        arms[arm] = rows
        for r in rows:
            curve = " ".join(f"{x:.1f}" for x in r["rate"])
            print(f"{arm:>8} {r['seed']}: v{r['versions'][0]}…v{r['versions'][-1]}: {curve}")

        cells = [
            _mean_std([r[key] for r in rows])
            for key in ("last", "gain", "worst_fall", "below_best", "late_std")
        ]
        table.append(f"| {arm} | {len(rows)} | {rows[0]['rate'][0]:.1f} % | {' | '.join(cells)} |")
    print("\n".join(table))
    if arms:
        plot(arms, args.plot)


if __name__ == "__main__":
    main()

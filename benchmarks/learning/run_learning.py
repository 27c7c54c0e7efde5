"""The learning benchmark: GAGPO against GiGPO, GRPO, RLOO and GAGPO λ ∈ {0, 1}, from the
same start, with the same seeds, budget and hyper-parameters except the estimator.

    python benchmarks/learning/run_learning.py                       # the whole grid
    python benchmarks/learning/run_learning.py --envs sokoban --seeds 0 --updates 4   # a probe
    python benchmarks/learning/run_learning.py --report-only         # plots + table from what ran

Each cell (env × start × estimator × seed) is one `gagpo run` of the env's shipped recipe
into its own store under OUT/<env>/<start>/<estimator>/seed<k>/, with the estimator, the
seeds and the budget (learner updates) set by --set. Cells run one after another; a finished
cell leaves `result.json` and is skipped when the benchmark is run again; an unfinished one
is started over. Starts: `warm` (the recipe's cached warm start) and `untrained` (the tiny
model as initialised). Per cell the result holds, per policy version, the rollouts it
generated, their success rate and valid-reply rate, and the environment steps generated up
to then; and the interquartile range of the stored advantages, computed in SQL (DuckDB over
the store's views). `--report-only` (also run at the end) draws success (and, from the
untrained start, valid replies) against environment steps, mean and min–max band across
seeds, into benchmarks/learning/<env>_<start>.png, and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ESTIMATORS = ("gagpo", "gigpo", "grpo", "rloo", "gagpo_lambda0", "gagpo_lambda1")
LABELS = {"gagpo_lambda0": "GAGPO λ=0", "gagpo_lambda1": "GAGPO λ=1"}
STARTS = ("warm", "untrained")
WINDOW = 5  # versions pooled for "final" and "steps to target" rates
SEED_STRIDE = 7919  # seed k plays tasks from k·stride: seeds see different tasks


def cell_dir(out: Path, env: str, start: str, estimator: str, seed: int) -> Path:
    return out / env / start / estimator / f"seed{seed}"


def run_cell(args, env: str, start: str, estimator: str, seed: int) -> dict | None:
    folder = cell_dir(args.out, env, start, estimator, seed)
    done = folder / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(folder, ignore_errors=True)  # an unfinished cell starts over
    folder.mkdir(parents=True)
    sets = {
        "run.report": "false",
        "run.actors": str(args.actors),
        "actors.seed": str(seed * SEED_STRIDE),
        "learner.seed": str(seed),
        "learner.updates": str(args.updates),
        "learner.batch_groups": str(args.batch_groups),
        "learner.estimator.estimator": estimator,
    }
    if args.group_size:
        sets["actors.group_size"] = str(args.group_size)
    cmd = [
        sys.executable,
        "-m",
        "gagpo.workflows.cli",
        "run",
        "--recipe",
        args.recipes.get(env, env),
        "--store",
        str(folder / "store"),
    ]
    for item in [f"{key}={value}" for key, value in sets.items()] + args.sets:
        cmd += ["--set", item]
    if start == "untrained":
        cmd.append("--no-warmstart")
    t0 = time.time()
    with open(folder / "run.log", "w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        print(f"  failed (exit {code}); see {folder / 'run.log'}", flush=True)
        return None
    result = measure(folder / "store", env) | {"seconds": time.time() - t0, "command": cmd}
    done.write_text(json.dumps(result, indent=1) + "\n")
    return result


def measure(store: str | Path, env: str = "") -> dict:
    """Per-version curve and advantage IQR, from the store's SQL views; the held-out
    evaluation (eval/heldout.parquet) where the recipe ran one; on Sokoban, how well the
    run's own advantages rank the solver's optimal moves (credit.py)."""
    from gagpo.inspection.sql import open_store_db, run_query

    con = open_store_db(str(store))
    rows = run_query(
        con,
        """
        SELECT policy_version AS version, count(*) AS rollouts, sum(length)::BIGINT AS steps,
               avg(success::DOUBLE) AS success,
               1 - sum(invalid_actions)::DOUBLE / sum(length)::DOUBLE AS valid
        FROM trajectories GROUP BY 1 ORDER BY 1
        """,
    ).to_pylist()
    iqr = run_query(
        con,
        """
        SELECT (quantile_cont(advantage, 0.75) - quantile_cont(advantage, 0.25))::DOUBLE AS iqr,
               count(*)::BIGINT AS n
        FROM advantages
        """,
    ).to_pylist()[0]
    steps = np.cumsum([r["steps"] for r in rows]).tolist()
    extra = {}
    heldout = Path(store) / "eval" / "heldout.parquet"
    if heldout.is_file():
        from gagpo.storage.store import parquet_table  # not pq.read_table (its doc)

        table = parquet_table(heldout.read_bytes()).to_pydict()
        at = dict(zip([r["version"] for r in rows], steps, strict=True))
        extra["heldout"] = {
            "versions": table["policy_version"],
            "env_steps": [at.get(v - 1, 0) for v in table["policy_version"]],  # before v played
            "success": table["success_rate"],
            "valid": table["valid_rate"],
            "rollouts": table["rollouts"],
        }
    if env == "sokoban":
        import polars as pl
        from credit import auc, label  # benchmarks/learning/credit.py

        moves = run_query(
            con,
            "select env, traj_id, step, policy_version, group_id, state_key, action_text from steps",
        )
        own = run_query(con, "select traj_id, step, advantage from advantages")
        labelled = label(pl.from_arrow(moves)).join(pl.from_arrow(own), on=["traj_id", "step"])
        extra["credit_auc"] = auc(labelled["advantage"].to_numpy(), labelled["optimal"].to_numpy())
    return extra | {
        "versions": [r["version"] for r in rows],
        "rollouts": [r["rollouts"] for r in rows],
        "env_steps": steps,  # generated up to the end of each version
        "success": [r["success"] for r in rows],
        "valid": [r["valid"] for r in rows],
        "advantage_iqr": iqr["iqr"],
        "advantage_rows": iqr["n"],
    }


# --- report --------------------------------------------------------------------------------


def _curve(result: dict, key: str, grid: np.ndarray) -> np.ndarray:
    """The rate over a window of WINDOW versions, against environment steps, on `grid`."""
    rates = [_window(result, key, i, WINDOW) for i in range(len(result["versions"]))]
    return np.interp(grid, result["env_steps"], rates)


def _window(result: dict, key: str, end: int, width: int) -> float:
    """Rate over the rollouts of versions end-width+1..end (weighted by rollouts): one
    version's 32 rollouts are too few to read a rate from."""
    lo = max(0, end - width + 1)
    n = np.array(result["rollouts"][lo : end + 1], dtype=float)
    return float((np.array(result[key][lo : end + 1]) * n).sum() / max(n.sum(), 1.0))


def _final(result: dict, key: str = "success") -> float:
    """Rate over the rollouts of the last WINDOW versions."""
    return _window(result, key, len(result["versions"]) - 1, WINDOW)


def _steps_to(result: dict, target: float) -> float | None:
    """Environment steps until the rate over a window of WINDOW versions reaches `target`."""
    for i, steps in enumerate(result["env_steps"]):
        if i + 1 >= WINDOW and _window(result, "success", i, WINDOW) >= target:
            return steps
    return None


HELDOUT_HEADER = [
    "| env | start | estimator | seeds | held-out success v0 | held-out success, last version "
    "| gain (paired by seed) | held-out valid replies, v0 → last | env steps "
    "| credit AUC (own advantages) | advantage IQR |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]


def _curves(first_valid: list[float]) -> list[str]:
    """Success, and valid replies where they have room to move (untrained, household)."""
    return ["success"] + (["valid"] if min(first_valid) < 0.95 else [])


def heldout_panel(args, env: str, start: str, cells: dict[str, list[dict]]) -> list[str]:
    """Table rows and a plot of held-out success (the same tasks for every version) against
    environment steps: mean and min–max band over seeds; held-out valid replies beside it
    where they have room to move (an untrained start)."""
    import matplotlib.pyplot as plt

    runs = [r for rs in cells.values() for r in rs]
    keys = _curves([r["heldout"]["valid"][0] for r in runs])
    fig, axes = plt.subplots(1, len(keys), figsize=(7 * len(keys), 4.2), squeeze=False)
    lines = []
    for est, results in cells.items():
        if not results:
            continue
        n = min(len(r["heldout"]["versions"]) for r in results)
        xs = np.mean([r["heldout"]["env_steps"][:n] for r in results], axis=0)
        for ax, key in zip(axes[0], keys, strict=True):
            ys = np.array([r["heldout"][key][:n] for r in results])
            (line,) = ax.plot(xs, ys.mean(0), marker="o", ms=3, label=LABELS.get(est, est.upper()))
            ax.fill_between(xs, ys.min(0), ys.max(0), alpha=0.12, color=line.get_color())
        ys = np.array([r["heldout"]["success"][:n] for r in results])
        valid = np.array([r["heldout"]["valid"][:n] for r in results])
        first, last = ys[:, 0], ys[:, -1]
        aucs = [r["credit_auc"] for r in results if "credit_auc" in r]
        lines.append(
            f"| {env} | {start} | {LABELS.get(est, est.upper())} | {len(results)} | "
            f"{first.mean():.1%} | {last.mean():.1%} ± {last.std():.1%} | "
            f"{(last - first).mean():+.1%} ± {(last - first).std():.1%} | "
            f"{valid[:, 0].mean():.1%} → {valid[:, -1].mean():.1%} ± {valid[:, -1].std():.1%} | "
            f"{xs[-1]:.0f} | {f'{np.mean(aucs):.3f}' if aucs else '—'} | "
            f"{np.mean([r['advantage_iqr'] for r in results]):.2f} |"
        )
    for ax, key in zip(axes[0], keys, strict=True):
        ax.set_xlabel("environment steps (trained rollouts generated before the version)")
        ax.set_ylabel(f"held-out {'success' if key == 'success' else 'valid-reply'} rate")
        ax.set_title(
            f"{env}, {start} start: held-out {key} per version\n"
            "(the same tasks for every version; mean, min–max over seeds)",
            fontsize=10,
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / f"{args.name}{env}_{start}.png", dpi=110)
    plt.close(fig)
    return [*HELDOUT_HEADER, *lines, ""]


def report(args) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [
        "| env | start | estimator | seeds | start success | final success | env steps to target "
        "(reached/seeds) | valid replies, version 0 → final | advantage IQR |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for env in args.envs:
        for start in args.starts:
            cells = {
                est: [
                    json.loads(p.read_text())
                    for s in args.seeds
                    if (p := cell_dir(args.out, env, start, est, s) / "result.json").is_file()
                ]
                for est in args.estimators
            }
            if not any(cells.values()):
                continue
            if all("heldout" in r for rs in cells.values() for r in rs):
                lines += heldout_panel(args, env, start, cells)
                continue
            first = [r["success"][0] for rs in cells.values() for r in rs]
            target = float(np.mean(first)) + args.target_gain
            keys = _curves([r["valid"][0] for rs in cells.values() for r in rs])
            fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
            for est, results in cells.items():
                if not results:
                    continue
                top = min(r["env_steps"][-1] for r in results)
                grid = np.linspace(0, top, 50)
                for ax, key in zip(axes[0], keys, strict=True):
                    ys = np.array([_curve(r, key, grid) for r in results])
                    (line,) = ax.plot(grid, ys.mean(0), label=LABELS.get(est, est.upper()))
                    ax.fill_between(grid, ys.min(0), ys.max(0), alpha=0.15, color=line.get_color())
                reached = [x for r in results if (x := _steps_to(r, target)) is not None]
                lines.append(
                    f"| {env} | {start} | {LABELS.get(est, est.upper())} | {len(results)} | "
                    f"{np.mean([r['success'][0] for r in results]):.1%} | "
                    f"{np.mean([_final(r) for r in results]):.1%} ± "
                    f"{np.std([_final(r) for r in results]):.1%} | "
                    f"{f'{np.mean(reached):.0f}' if reached else '—'} ({len(reached)}/{len(results)}) | "
                    f"{np.mean([r['valid'][0] for r in results]):.1%} → "
                    f"{np.mean([_final(r, 'valid') for r in results]):.1%} ± "
                    f"{np.std([_final(r, 'valid') for r in results]):.1%} | "
                    f"{np.mean([r['advantage_iqr'] for r in results]):.2f} |"
                )
            for ax, key in zip(axes[0], keys, strict=True):
                ax.set_xlabel("environment steps")
                ax.set_ylabel("success rate" if key == "success" else "valid-reply rate")
                ax.axhline(target, color="grey", lw=0.6, ls="--") if key == "success" else None
                ax.set_title(
                    f"{env}, {start} start: mean, min–max over seeds\n"
                    f"(rate over the rollouts of {WINDOW} versions)",
                    fontsize=10,
                )
                ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(HERE / f"{args.name}{env}_{start}.png", dpi=110)
            plt.close(fig)
    lines.append(
        f"\nTarget = mean start success of the panel + {args.target_gain:.0%} (dashed line), "
        f"read over a window of {WINDOW} versions; final = the last {WINDOW} versions."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", default="sokoban,household")
    parser.add_argument("--starts", default=",".join(STARTS))
    parser.add_argument("--estimators", default=",".join(ESTIMATORS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--updates", type=int, default=40, help="learner updates per cell")
    parser.add_argument("--batch-groups", type=int, default=4, help="groups per update")
    parser.add_argument("--group-size", type=int, default=0, help="G (0: the recipe's)")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--target-gain", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=HERE / "runs")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="ENV=RECIPE",
        help="the recipe of an env's cells (default: the env's own recipe)",
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="extra --set for every cell (same for every estimator)",
    )
    parser.add_argument("--name", default="", help="prefix of the plots' file names")
    args = parser.parse_args()
    args.envs, args.starts = args.envs.split(","), args.starts.split(",")
    args.estimators = args.estimators.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.recipes = dict(item.split("=", 1) for item in args.recipe)
    os.environ.setdefault("GAGPO_CACHE", str(Path.cwd() / ".cache" / "gagpo"))
    if not args.report_only:
        cells = [
            (e, st, est, s)
            for e in args.envs
            for st in args.starts
            for s in args.seeds
            for est in args.estimators
        ]
        for i, (env, start, est, seed) in enumerate(cells, 1):
            marker = cell_dir(args.out, env, start, est, seed) / "result.json"
            state = "done, skipped" if marker.is_file() else "running"
            print(f"[{i}/{len(cells)}] {env} {start} {est} seed {seed}: {state}", flush=True)
            result = run_cell(args, env, start, est, seed)
            if result is not None and "seconds" in result and state == "running":
                print(
                    f"  {result['seconds']:.0f}s: success {result['success'][0]:.1%} → "
                    f"{_final(result):.1%}, valid {_final(result, 'valid'):.1%}, "
                    f"advantage IQR {result['advantage_iqr']:.2f}",
                    flush=True,
                )
    print(report(args))


if __name__ == "__main__":
    main()

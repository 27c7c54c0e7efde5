"""Issue 23's learning comparison: does state grouping change what RL learns?

    python benchmarks/learning/grouping_learning.py                     # exact vs normalized, 3 seeds
    python benchmarks/learning/grouping_learning.py --modes exact minhash:0.8 --seeds 0 1
    python benchmarks/learning/grouping_learning.py --report-only

The environment is `Rooms` (benchmarks/bench_grouping.py) through the Gym adapter, keyed by
its observation text, which repeats the turn number and the last reply: exact keys almost
never repeat across a group's rollouts, so exact pools are mostly single steps and GAGPO's
value proxy is each step's own return. It is not a built-in, so this script registers it as
the entry point `rooms` with a dist-info folder on PYTHONPATH (nothing is installed).

Each cell (mode × seed) is one `gagpo run --recipe benchmarks/learning/rooms.toml` into its own
store under OUT/<mode>/seed<k>/: the same warm start (cached after the first cell), the same
budget and hyper-parameters, only `learner.estimator.state_grouping` differs. A finished
cell leaves `result.json` and is skipped when run again. The result is the held-out success
(the recipe's eval_groups tasks, the same for every cell) of v0, every eval_every-th version and the
last; the table gives each version's mean ± std over seeds and the mean over versions.
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
ROOT = HERE.parent.parent
RECIPE = HERE / "rooms.toml"  # not shipped: `rooms` is registered by this script only
SEED_STRIDE = 7919  # as run_learning.py: seed k plays tasks from k·stride
ENTRY_POINTS = "[gagpo.envs]\nrooms = bench_grouping:Rooms\n"


def plugin_path(out: Path) -> str:
    """A folder holding a dist-info that names `rooms`; importlib.metadata finds entry
    points in any sys.path entry, so PYTHONPATH registers it for the runs' processes."""
    info = out / "plugin" / "gagpo_bench_rooms-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: gagpo-bench-rooms\nVersion: 0.0.0\n"
    )
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return os.pathsep.join([str(out / "plugin"), str(ROOT / "benchmarks")])


def run_cell(args, mode: str, seed: int, env: dict) -> dict | None:
    folder = args.out / mode.replace(":", "_") / f"seed{seed}"
    done = folder / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    sets = {
        "actors.seed": str(seed * SEED_STRIDE),
        "learner.seed": str(seed),
        "learner.updates": str(args.updates),
        "learner.estimator.state_grouping": mode,
    }
    cmd = [
        sys.executable,
        "-m",
        "gagpo.workflows.cli",
        "run",
        "--recipe",
        str(RECIPE),
        "--store",
        str(folder / "store"),
    ]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    t0 = time.time()
    with open(folder / "run.log", "w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        print(f"  {mode} seed {seed}: failed (exit {code}); see {folder / 'run.log'}", flush=True)
        return None
    result = measure(folder / "store") | {
        "seconds": time.time() - t0,
        "mode": mode,
        "seed": seed,
        "command": cmd,
    }
    done.write_text(json.dumps(result, indent=1) + "\n")
    return result


def measure(store: Path) -> dict:
    """Held-out success of the first and last evaluated versions; singleton share of the
    trained steps under exact and under the cell's own grouping is in its advantages."""
    import polars as pl

    heldout = pl.read_parquet(store / "eval" / "heldout.parquet").sort("policy_version")
    first, last = heldout.row(0, named=True), heldout.row(-1, named=True)
    steps = pl.scan_parquet(str(store / "shards" / "**" / "*.parquet")).select(pl.len()).collect()
    return {
        "v0_success": first["success_rate"],
        "last_version": last["policy_version"],
        "last_success": last["success_rate"],
        "last_valid": last.get("valid_rate"),
        "rollouts": last["rollouts"],
        "trained_steps": int(steps.item()),
        "curve": {
            int(r["policy_version"]): r["success_rate"] for r in heldout.iter_rows(named=True)
        },
    }


def report(results: list[dict], modes: list[str]) -> str:
    done = [r for r in results if r]
    versions = sorted({int(v) for r in done for v in r["curve"]})
    head = " | ".join(f"v{v}" for v in versions)
    lines = [
        f"| mode | seeds | {head} | mean over versions |",
        "|---|---|" + "---|" * len(versions) + "---|",
    ]
    for mode in modes:
        rows = [r for r in results if r and r["mode"] == mode]
        if not rows:
            continue
        curve = np.array(
            [
                [r["curve"][str(v)] if str(v) in r["curve"] else r["curve"][v] for v in versions]
                for r in rows
            ]
        )
        cells = " | ".join(
            f"{100 * m:.1f} ± {100 * d:.1f}"
            for m, d in zip(curve.mean(0), curve.std(0), strict=True)
        )
        area = curve.mean(1)
        lines.append(
            f"| {mode} | {len(rows)} | {cells} | {100 * area.mean():.1f} ± "
            f"{100 * area.std():.1f} % |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["exact", "normalized"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--updates", type=int, default=16)
    parser.add_argument("--out", type=Path, default=HERE / "runs" / "grouping")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [plugin_path(args.out), env.get("PYTHONPATH")])
    )
    results = []
    for seed in args.seeds:  # seeds outermost: a cut-short run still compares the modes
        for mode in args.modes:
            path = args.out / mode.replace(":", "_") / f"seed{seed}" / "result.json"
            if args.report_only:
                results.append(json.loads(path.read_text()) if path.is_file() else None)
                continue
            print(f"{mode} seed {seed} …", flush=True)
            results.append(run_cell(args, mode, seed, env))
            if results[-1]:
                r = results[-1]
                print(
                    f"  v0 {r['v0_success']:.1%} → v{r['last_version']} {r['last_success']:.1%}"
                    f" ({r['seconds']:.0f} s)",
                    flush=True,
                )
    print(report(results, args.modes))


if __name__ == "__main__":
    main()

"""Does the learner's background compaction slow training or the actors? Side by side.

    python benchmarks/bench_compaction_background.py --updates 24 --every 2 --seeds 0 1 2

Runs the demo recipe (two actors, the GAGPO learner; no held-out evaluation) once with
compaction after every `--every` updates and once with it off, for each seed, and
compares the learner's time per update (`update_s` of learner_metrics: the forward,
backward and optimiser work the compaction thread runs beside), its wait for data
(`wait_s`) and the actors' generation rate (their closing lines' steps/s). Results go to
stdout as a Markdown table (mean ± std over seeds, and the ratio on / off).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GAGPO = str(Path(sys.executable).with_name("gagpo"))
ACTOR_RATE = re.compile(r"\[actor \d+\] run \S+: .* in [\d.]+s \(([\d.]+) steps/s")


def run(store: Path, updates: int, every: int, seed: int) -> dict:
    from gagpo.inspection.sql import query_store

    env = dict(os.environ, HOME=str(store.parent / "home"), TMPDIR=str(store.parent))
    cmd = [
        GAGPO,
        "run",
        "--store",
        str(store),
        "--recipe",
        "demo",
        "--set",
        f"learner.updates={updates}",
        "--set",
        "run.eval_groups=0",
        "--set",
        f"learner.seed={seed}",
        "--set",
        f"actors.seed={1000 * seed}",
        "--set",
        f"learner.compaction.every_updates={every}",
        "--set",
        "learner.compaction.min_mib=0",
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(
            f"gagpo run failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    metrics = query_store(
        str(store), 'SELECT update_s, wait_s FROM learner_metrics ORDER BY "update"'
    )
    rates = [float(r) for r in ACTOR_RATE.findall(done.stdout + done.stderr)]
    compactions = len(re.findall(r"\[learner\] compaction \d+:", done.stdout + done.stderr))
    return {
        "update_s": statistics.median(metrics["update_s"].to_pylist()),
        "wait_s": statistics.median(metrics["wait_s"].to_pylist()),
        "actor_steps_s": sum(rates),
        "wall_s": wall,
        "compactions": compactions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=24)
    parser.add_argument("--every", type=int, default=2, help="compact every N updates (on)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="gagpo-bg-") as tmp:
        for seed in args.seeds:
            for mode, every in (("on", args.every), ("off", 0)):  # alternate: drift hits both
                store = Path(tmp) / f"{mode}-{seed}" / "store"
                store.parent.mkdir(parents=True)
                results[mode].append(run(store, args.updates, every, seed))
                r = results[mode][-1]
                print(
                    f"seed {seed} compaction {mode}: median update {r['update_s']:.3f} s, "
                    f"wait {r['wait_s']:.3f} s, actors {r['actor_steps_s']:.1f} steps/s, "
                    f"{r['compactions']} compaction(s), {r['wall_s']:.0f} s",
                    file=sys.stderr,
                )

    def stat(mode: str, key: str) -> tuple[float, float]:
        values = [r[key] for r in results[mode]]
        return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    print(
        f"`python benchmarks/bench_compaction_background.py --updates {args.updates} "
        f"--every {args.every} --seeds {' '.join(map(str, args.seeds))}` "
        f"({os.cpu_count()} cores, {time.strftime('%Y-%m-%d')})\n"
    )
    print(
        "| measurement | compaction every "
        f"{args.every} updates | compaction off | on / off |\n|---|---:|---:|---:|"
    )
    for key, label in (
        ("update_s", "learner: median time per update (s)"),
        ("wait_s", "learner: median wait for data (s)"),
        ("actor_steps_s", "actors: steps/s, both together"),
        ("wall_s", "run wall time (s)"),
    ):
        on, off = stat("on", key), stat("off", key)
        print(
            f"| {label} | {on[0]:.3f} ± {on[1]:.3f} | {off[0]:.3f} ± {off[1]:.3f} | "
            f"{on[0] / off[0] if off[0] else float('nan'):.2f}× |"
        )
    print(
        f"| compactions per run | {stat('on', 'compactions')[0]:.0f} | "
        f"{stat('off', 'compactions')[0]:.0f} | |"
    )


if __name__ == "__main__":
    main()

"""Ray's overhead on `gagpo run`: wall time of the tiny recipe with 20 updates, plain and
with `--ray` (a local instance started and shut down by the run), side by side.

    python benchmarks/bench_ray_run.py [--updates 20] [--repeats 1]

The warm start is built (or taken from the cache) once before the timed runs; evaluation,
report and credit comparison are off in both, so the figure is the processes' lifetime.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

QUICK = ["--set", "run.eval_groups=0", "--set", "run.report=false", "--set", "run.credit=false"]


def timed(args: list[str], store: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gagpo.workflows.cli",
            "run",
            "--recipe",
            "tiny",
            "--store",
            store,
            *QUICK,
            *args,
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-2000:])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    opts = parser.parse_args()
    sets = ["--set", f"learner.updates={opts.updates}"]
    with tempfile.TemporaryDirectory() as tmp:
        timed(["--set", "learner.updates=1"], os.path.join(tmp, "warm"))  # the cached warm start
        rows = []
        for r in range(opts.repeats):
            plain = timed(sets, os.path.join(tmp, f"plain{r}"))
            on_ray = timed([*sets, "--ray"], os.path.join(tmp, f"ray{r}"))
            rows.append((plain, on_ray))
    print(f"tiny recipe, {opts.updates} updates, 1 actor; cpus {os.cpu_count()}")
    print("run  plain_s  ray_s  overhead_s  ratio")
    for r, (plain, on_ray) in enumerate(rows):
        print(f"{r:>3}  {plain:7.1f}  {on_ray:5.1f}  {on_ray - plain:10.1f}  {on_ray / plain:5.2f}")


if __name__ == "__main__":
    main()

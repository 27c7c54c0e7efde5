"""Backpressure benchmark (issue 9): what becomes of the groups the actors generate.

A fast actor (`--follow`, the tiny policy on `household`) and a slower learner run as
separate processes on one store, once with the actor's throttle and once without
(`--no-throttle`, the behaviour before backpressure). For each: groups generated,
trained, dropped as stale and never read, the actor's time spent throttled, and the
learner's wall time. Read from the store and the ledger, as `gagpo run` reports it.

    python benchmarks/bench_backpressure.py                    # 10 updates, B = 2, S = 1
    python benchmarks/bench_backpressure.py --updates 20 --batch-groups 4 --max-staleness 2
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gagpo.learner.feed import STALE, TRAINED, Ledger  # noqa: E402
from gagpo.schemas import columns as C  # noqa: E402
from gagpo.storage.store import Store  # noqa: E402
from tests.helpers.actors import actors_command  # noqa: E402
from tests.helpers.learner import learner_beside_actors  # noqa: E402


def one_run(store_dir: Path, args, throttle: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    actor = subprocess.Popen(
        actors_command(
            store_dir,
            "--throttle" if throttle else "--no-throttle",
            env="household",
            follow=True,
            group_size=4,
            max_turns=3,
        ),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    t0 = time.perf_counter()
    try:
        learner = subprocess.run(
            learner_beside_actors(
                store_dir,
                updates=args.updates,
                batch_groups=args.batch_groups,
                max_staleness=args.max_staleness,
                idle_timeout=300,
            ),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        learner_s = time.perf_counter() - t0
    finally:
        actor.send_signal(signal.SIGTERM)
        out, _ = actor.communicate(timeout=300)
    if learner.returncode != 0:
        raise SystemExit(learner.stderr[-2000:])
    store = Store(str(store_dir))
    generated = sum(
        len(store.read_table(r.path, [C.GROUP_ID])[C.GROUP_ID].unique())
        for r in store.list_shards()
    )
    status = pl.from_arrow(Ledger.load(store).table())["status"]
    trained, stale = int((status == TRAINED).sum()), int((status == STALE).sum())
    waited = re.search(r"throttled \(waiting for the learner's backlog\) ([\d.]+)s", out)
    return {
        "generated": generated,
        "trained": trained,
        "stale": stale,
        "never_read": generated - trained - stale,
        "used": trained / max(generated, 1),
        "throttled_s": float(waited.group(1)) if waited else float("nan"),
        "learner_s": learner_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--batch-groups", type=int, default=2)
    parser.add_argument("--max-staleness", type=int, default=1)
    args = parser.parse_args()
    print(
        f"{platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; updates {args.updates}, B {args.batch_groups}, "
        f"max_staleness {args.max_staleness}"
    )
    print("throttle  generated  trained  stale  never_read  used   actor_throttled_s  learner_s")
    for throttle in (False, True):
        with tempfile.TemporaryDirectory(prefix="gagpo-bp-") as tmp:
            r = one_run(Path(tmp) / "store", args, throttle)
        print(
            f"{'on' if throttle else 'off':>8}  {r['generated']:>9}  {r['trained']:>7}  "
            f"{r['stale']:>5}  {r['never_read']:>10}  {r['used']:>4.0%}  "
            f"{r['throttled_s']:>17.1f}  {r['learner_s']:>9.1f}"
        )


if __name__ == "__main__":
    main()

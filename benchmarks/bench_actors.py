"""Actor and storage benchmark (issue #2).

Runs `gagpo-actors`' loop in-process on a temporary store and reports, side by side:
- bytes per step of the committed zstd Parquet shards against the same rows as JSON lines;
- the share of actor wall time spent writing shards;
- steps/s per (environment, policy).

    python benchmarks/bench_actors.py                       # tiny on all five envs + smollm2 on household
    python benchmarks/bench_actors.py --policies tiny --groups 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from datetime import UTC, datetime

import polars as pl

from gagpo.actors.actor import run_actor
from gagpo.actors.config import ActorConfig, SamplingConfig
from gagpo.envs import make_env
from gagpo.storage.store import Store


def jsonl_bytes(store: Store) -> tuple[int, int, int]:
    """(parquet bytes, JSON-lines bytes, rows) over every committed shard."""
    parquet = rows = 0
    json_total = 0
    for ref in store.list_shards():
        parquet += store.fs.size(ref.path)
        frame = pl.from_arrow(store.read_shard(ref))
        rows += frame.height
        for record in frame.iter_rows(named=True):
            json_total += len(json.dumps(record, default=str)) + 1
    return parquet, json_total, rows


def bench(
    env: str, policy: str, groups: int, group_size: int, max_turns: int, threads: int
) -> dict:
    # Generated games (textworld, alfworld) are built once and cached: build them before
    # timing, so that steps/s is the steady state an actor sees.
    for k in range(groups):
        make_env(env, max_turns).reset(1 + k)
    with tempfile.TemporaryDirectory() as tmp:
        config = ActorConfig(
            store=tmp,
            env=env,
            policy=policy,
            groups=groups,
            group_size=group_size,
            max_turns=max_turns,
            seed=1,
            sampling=SamplingConfig(max_new_tokens=16),
        )
        summary = run_actor(config)
        parquet, jsonl, rows = jsonl_bytes(Store(tmp))
    assert rows == summary.steps
    return {
        "env": env,
        "policy": policy,
        "threads": threads,
        "steps": summary.steps,
        "steps_per_s": summary.steps_per_second,
        "write_share": summary.seconds_write / summary.seconds_total,
        "generate_share": summary.seconds_generate / summary.seconds_total,
        "parquet_bytes_per_step": parquet / rows,
        "jsonl_bytes_per_step": jsonl / rows,
        "success_rate": summary.success_rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="tiny,smollm2-135m")
    parser.add_argument("--envs", default="sokoban,household,textworld,alfworld,webshop")
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=15)
    parser.add_argument("--smollm2-groups", type=int, default=1)
    parser.add_argument(
        "--threads", default="1", help="comma-separated torch thread counts to compare"
    )
    args = parser.parse_args()

    results = []
    for policy in args.policies.split(","):
        for env in args.envs.split(","):
            if policy != "tiny" and env != "household":
                continue  # the real model is measured on one environment: it dominates the time
            groups = args.smollm2_groups if policy != "tiny" else args.groups
            for threads in (int(t) for t in args.threads.split(",")):
                results.append(bench(env, policy, groups, args.group_size, args.max_turns, threads))
                report(results[-1])
    print(
        json.dumps(
            {
                "machine": f"{platform.machine()} {os.cpu_count()} cores",
                "date": datetime.now(UTC).date().isoformat(),
                "results": results,
            },
            indent=1,
        )
    )


def report(r: dict) -> None:
    print(
        f"{r['env']:<10} {r['policy']:<14} threads {r['threads']}  steps {r['steps']:>5}  "
        f"{r['steps_per_s']:8.1f} steps/s  write {r['write_share']:6.2%}  "
        f"generate {r['generate_share']:6.1%}  bytes/step parquet {r['parquet_bytes_per_step']:7.0f} "
        f"vs jsonl {r['jsonl_bytes_per_step']:7.0f} "
        f"({r['jsonl_bytes_per_step'] / r['parquet_bytes_per_step']:.1f}x smaller)",
        flush=True,
    )


if __name__ == "__main__":
    main()

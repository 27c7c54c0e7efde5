"""`gagpo advantages --store S --workers N`: shards/s against the number of workers, next to
the I/O floor (reading every shard and committing every advantages file, no compute).

    python benchmarks/bench_recompute_workers.py [--shards 16] [--steps-per-shard 25000]
        [--workers 1,2,4] [--ray]

The store holds synthetic whole-group shards (bench_advantages.synthetic_steps, the other
step columns constant); each measurement recomputes into a fresh copy of the advantages
folder. Processes are spawned per run, so their start-up is in the figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_advantages import synthetic_steps

from gagpo.pipeline.config import parse_estimator_config
from gagpo.pipeline.recompute import recompute_store
from gagpo.schemas import columns as C
from gagpo.storage.store import Store


def build(root: str, shards: int, steps: int) -> int:
    store = Store(root)
    total = 0
    for i in range(shards):
        core = synthetic_steps(steps, seed=i).with_columns(
            (pl.lit(f"s{i:04d}-") + pl.col(C.GROUP_ID)).alias(C.GROUP_ID),
            (pl.lit(f"s{i:04d}-") + pl.col(C.TRAJ_ID)).alias(C.TRAJ_ID),
        )
        last = pl.col(C.DONE) | pl.col(C.TRUNCATED)
        table = core.with_columns(
            pl.lit("bench").alias(C.RUN_ID),
            pl.lit(f"s{i:04d}").alias(C.SHARD_ID),
            pl.lit("bench").alias(C.ENV),
            pl.col(C.GROUP_ID).alias(C.TASK_ID),
            pl.lit("obs").alias(C.OBSERVATION),
            pl.lit([1, 2, 3]).alias(C.PROMPT_IDS),
            pl.lit("go").alias(C.ACTION_TEXT),
            pl.lit([4, 5]).alias(C.ACTION_IDS),
            pl.lit([-0.5, -1.0]).alias(C.BEHAVIOR_LOGPROBS),
            pl.lit(0).alias(C.POLICY_VERSION),
            pl.lit(True).alias(C.ACTION_VALID),
            (last & (pl.col(C.REWARD) > 0)).alias(C.WON),
            pl.lit(0).cast(pl.Datetime("us", "UTC")).alias(C.CREATED_AT),
        )
        arrow = table.select(list(C.STEPS_COLUMNS)).to_arrow().cast(C.STEPS_SCHEMA)
        store.write_shard(arrow, group_size=8)
        total += table.height
    return total


def floor(root: str, tag: str) -> float:
    """Read and decode every shard, commit every advantages file's bytes: no compute."""
    store = Store(root)
    outputs = {p.name: p.read_bytes() for p in (Path(root) / "advantages" / tag).iterdir()}
    start = time.perf_counter()
    for ref in store.list_shards():
        store.read_shard(ref)
        store.commit_bytes(
            store.advantages_path("floor", ref.shard_id), outputs[f"{ref.shard_id}.parquet"]
        )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--steps-per-shard", type=int, default=25_000)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--ray", action="store_true", help="also Ray tasks (local instance)")
    opts = parser.parse_args()
    config = parse_estimator_config({})
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "store")
        steps = build(root, opts.shards, opts.steps_per_shard)
        rows = []
        backends = [("processes", int(w)) for w in opts.workers.split(",")]
        if opts.ray:
            backends += [("ray", int(w)) for w in opts.workers.split(",") if int(w) > 1]
        for backend, workers in backends:
            shutil.rmtree(os.path.join(root, "advantages"), ignore_errors=True)
            start = time.perf_counter()
            recompute_store(
                root, None, config, workers=workers, backend="serial" if workers == 1 else backend
            )
            rows.append(
                (f"{backend if workers > 1 else 'serial'}", workers, time.perf_counter() - start)
            )
        io_s = floor(root, config.tag)
    print(
        f"{opts.shards} shards, {steps} steps ({steps // opts.shards} per shard); "
        f"cpus {os.cpu_count()}"
    )
    print("backend    workers  seconds  shards/s  steps/s    x_floor")
    for backend, workers, seconds in rows:
        print(
            f"{backend:<10} {workers:>7}  {seconds:7.2f}  {opts.shards / seconds:8.2f}  "
            f"{steps / seconds:9.0f}  {seconds / io_s:6.2f}"
        )
    print(
        f"{'I/O floor':<10} {1:>7}  {io_s:7.2f}  {opts.shards / io_s:8.2f}  {steps / io_s:9.0f}"
        "    1.00"
    )


if __name__ == "__main__":
    main()

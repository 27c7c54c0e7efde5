"""Benchmark of the advantage stage: Parquet in → GAGPO advantages → Parquet out.

Three variants, side by side in one run, each in its own process (peak memory is the
process's max RSS):

  polars  the stage as `gagpo advantages --input --out` runs it: scan the input
          columns, compute (`compute_advantages`, checks included), write the table
          with its metadata (diagnostics, printed by the CLI, are not included)
  python  the straightforward per-group Python implementation (gagpo.pipeline.reference)
          with the same reading and writing, on a sample of whole groups (it is too slow
          for millions of steps), extrapolated per step
  floor   the bare I/O: scan the same input columns and write a table of exactly the
          output's content (computed beforehand, untimed)

Synthetic data of realistic shape: G = 8 rollouts per group, 5–50 turns, states that
repeat within a group (rollouts of a task pass through the same few states per depth,
some revisited), 70 % of rollouts terminate and 30 % are truncated; rows are stored
rollout by rollout, group by group, as actors write them (`--shuffled` stores them in
random order instead).

    python benchmarks/bench_advantages.py                       # 1M steps
    python benchmarks/bench_advantages.py --steps 10000000 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl

from gagpo.schemas import columns as C

VARIANTS = ("polars", "python", "floor")


def synthetic_steps(n_steps: int, seed: int = 0, group_size: int = 8) -> pl.DataFrame:
    """About `n_steps` steps of whole groups; vectorised (no per-row Python)."""
    rng = np.random.default_rng(seed)
    n_groups = max(1, round(n_steps / (group_size * 27.5)))
    lengths = rng.integers(5, 51, size=n_groups * group_size)
    traj = np.repeat(np.arange(lengths.shape[0]), lengths)
    group = traj // group_size
    step = np.arange(traj.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    last = np.zeros(traj.shape[0], bool)
    last[np.cumsum(lengths) - 1] = True
    # Per depth (two turns) a rollout is in one of three states; 10 % revisit the start.
    state = (step // 2) * 3 + rng.integers(0, 3, traj.shape[0])
    state = np.where(rng.random(traj.shape[0]) < 0.1, 0, state)
    done = last & (rng.random(traj.shape[0]) < 0.7)
    truncated = last & ~done
    success = rng.random(traj.shape[0]) < 0.5
    invalid = rng.random(traj.shape[0]) < 0.1
    reward = np.where(done & success, 1.0, np.where(invalid, -0.1, 0.0)).astype(np.float32)
    # Truncated rollouts end towards a state one depth further (often seen by the group).
    after = state + 3
    frame = pl.DataFrame(
        {
            "g": group,
            "t": traj,
            C.STEP: step.astype(np.int32),
            "s": state,
            "after": after,
            C.REWARD: reward,
            C.DONE: done,
            C.TRUNCATED: truncated,
        }
    )
    group_id = pl.format("01JD{}K8Y3QW9V5XG2T7N", pl.col("g").cast(pl.String).str.zfill(8))
    key = "room=kitchen;holding=apple;fridge=open;at={}-{}"
    return frame.select(
        group_id.alias(C.GROUP_ID),
        pl.format("{}-{}", group_id, pl.col("t") % group_size).alias(C.TRAJ_ID),
        pl.col(C.STEP),
        pl.format(key, pl.col("g"), pl.col("s")).alias(C.STATE_KEY),
        pl.when(pl.col(C.DONE))
        .then(None)
        .when(pl.col(C.TRUNCATED))
        .then(pl.format(key, pl.col("g"), pl.col("after")))
        .otherwise(pl.format(key, pl.col("g"), pl.col("s").shift(-1)))
        .alias(C.NEXT_STATE_KEY),
        pl.col(C.REWARD),
        pl.col(C.DONE),
        pl.col(C.TRUNCATED),
    )


# --- the variants (each runs in a child process) -----------------------------------------


def run_polars(src: str, out: str, codec: str, extra: dict) -> int:
    """What `gagpo advantages --input SRC --out OUT` runs; the diagnostics it then prints
    are timed apart (`extra`)."""
    from gagpo.pipeline import diagnostics, parse_estimator_config
    from gagpo.pipeline.recompute import advantages_of_files, write_advantages

    config = parse_estimator_config({"estimator": "gagpo"})
    table = advantages_of_files([src], config)
    write_advantages(table, out, config, codec)
    start, cpu = time.perf_counter(), _cpu_seconds()
    diagnostics(table)
    extra["diagnostics_seconds"] = time.perf_counter() - start
    extra["diagnostics_cpu_seconds"] = _cpu_seconds() - cpu
    return table.height


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_floor(src: str, out: str, table: pl.DataFrame, codec: str) -> int:
    from gagpo.pipeline import parse_estimator_config
    from gagpo.pipeline.recompute import write_advantages

    steps = pl.scan_parquet(src).select(C.ADVANTAGE_INPUT_COLUMNS).collect()
    write_advantages(table, out, parse_estimator_config({}), codec)
    return steps.height


def run_python(sample: str, out: str, codec: str) -> int:
    from gagpo.pipeline import parse_estimator_config
    from gagpo.pipeline.recompute import write_advantages
    from gagpo.pipeline.reference import reference_advantages

    config = parse_estimator_config({"estimator": "gagpo"})
    steps = pl.read_parquet(sample)  # whole groups drawn from the input (see `generate`)
    rows = reference_advantages(steps.to_dicts(), config)
    write_advantages(pl.DataFrame(rows, schema=_output_schema()), out, config, codec)
    return steps.height


def _output_schema() -> pl.Schema:
    from gagpo.pipeline import OUTPUT_SCHEMA

    return OUTPUT_SCHEMA


def child(args: argparse.Namespace) -> None:
    """Run one variant once; print its seconds, steps and peak RSS as JSON."""
    import gagpo.pipeline.recompute
    import gagpo.pipeline.reference  # noqa: F401  (imports are not part of the measure)
    from gagpo.pipeline.memory import reuse_freed_memory

    reuse_freed_memory()  # as `gagpo advantages` does, for every variant alike

    table = pl.read_parquet(args.expected) if args.child == "floor" else None
    pl.scan_parquet(args.input).select(C.ADVANTAGE_INPUT_COLUMNS).head(1).collect()
    cpu_start = _cpu_seconds()
    extra: dict = {}
    start = time.perf_counter()
    if args.child == "polars":
        steps = run_polars(args.input, args.out, args.compression, extra)
    elif args.child == "floor":
        steps = run_floor(args.input, args.out, table, args.compression)
    else:
        steps = run_python(args.sample, args.out, args.compression)
    seconds = time.perf_counter() - start - extra.get("diagnostics_seconds", 0.0)
    cpu = _cpu_seconds() - cpu_start - extra.get("diagnostics_cpu_seconds", 0.0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu_seconds": cpu,
                "steps": steps,
                "peak_bytes": peak,
                **extra,
            }
        )
    )


def spawn(
    variant: str, args: argparse.Namespace, src: Path, expected: Path, sample: Path, work: Path
) -> dict:
    out = work / f"out-{variant}.parquet"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--input",
        str(src),
        "--out",
        str(out),
        "--expected",
        str(expected),
        "--sample",
        str(sample),
        "--compression",
        args.compression,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr}")
    out.unlink(missing_ok=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the run ---------------------------------------------------------------------------


def prepare(n_steps: int, work: Path, shuffled: bool, sample: int) -> tuple[Path, Path, Path, int]:
    """Generate the input, the expected output and the Python variant's sample once, in
    a child process: a child inherits its parent's peak RSS at fork, so the parent must
    stay small."""
    suffix = f"{n_steps}{'-shuffled' if shuffled else ''}"
    src, expected = work / f"steps-{suffix}.parquet", work / f"expected-{suffix}.parquet"
    sample_file = work / f"sample-{suffix}-{sample}.parquet"
    if not (src.exists() and expected.exists() and sample_file.exists()):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "prepare",
            "--steps",
            str(n_steps),
            "--input",
            str(src),
            "--expected",
            str(expected),
            "--sample",
            str(sample_file),
            "--python-sample",
            str(sample),
        ]
        subprocess.run(cmd + (["--shuffled"] if shuffled else []), check=True)
    rows = pl.scan_parquet(src).select(pl.len()).collect().item()
    return src, expected, sample_file, rows


def generate(
    n_steps: int, src: Path, expected: Path, sample_file: Path, sample: int, shuffled: bool
) -> None:
    if not src.exists():
        steps = synthetic_steps(n_steps)
        if shuffled:
            steps = steps.sample(fraction=1.0, shuffle=True, seed=1)
        steps.write_parquet(src, compression="zstd")
    if not expected.exists():
        from gagpo.pipeline import compute_advantages, parse_estimator_config

        config = parse_estimator_config({})
        compute_advantages(pl.scan_parquet(src), config).collect().write_parquet(expected)
    if not sample_file.exists():
        # Whole groups, about `sample` steps, in the input's row order.
        every = max(1, n_steps // sample)
        steps = pl.scan_parquet(src).select(C.ADVANTAGE_INPUT_COLUMNS)
        chosen = steps.filter(pl.col(C.GROUP_ID).hash(seed=7) % every == 0)
        chosen.collect().write_parquet(sample_file)


def warm_memory(gib: float) -> None:
    """Touch `gib` GiB in a throw-away process. On this VM the host backs guest memory
    lazily, so the first touch of a page since boot costs up to ~1 ms/MB, and whichever
    variant runs first would pay for it; afterwards a page fault costs what it costs on
    any machine (every variant still faults in its own memory)."""
    code = f"import numpy as np; np.ones(int({gib} * 2**30 / 8))"
    subprocess.run([sys.executable, "-c", code], check=True)


def measure(args: argparse.Namespace) -> dict:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-advantages-"))
    work.mkdir(parents=True, exist_ok=True)
    src, expected, sample, n = prepare(args.steps, work, args.shuffled, args.python_sample)
    if args.warm_gib:
        warm_memory(args.warm_gib)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):  # interleaved, so load changes hit every variant alike
        for variant in VARIANTS:
            runs[variant].append(spawn(variant, args, src, expected, sample, work))
    result = {
        "steps": n,
        "input_bytes": src.stat().st_size,
        "compression": args.compression,
        "warm_gib": args.warm_gib,
        "load_average": (load_before, os.getloadavg()[0]),
        "variants": {},
    }
    for variant, rs in runs.items():
        # Per step, then times all steps: the python variant is extrapolated from its sample.
        seconds = [r["seconds"] / r["steps"] * n for r in rs]
        cpu = [r["cpu_seconds"] / r["steps"] * n for r in rs]
        result["variants"][variant] = {
            "seconds_min": min(seconds),
            "seconds_median": statistics.median(seconds),
            "cpu_seconds_min": min(cpu),
            "steps_measured": rs[0]["steps"],
            "peak_gib": max(r["peak_bytes"] for r in rs) / 2**30,
            "diagnostics_seconds": min(r.get("diagnostics_seconds", 0.0) for r in rs),
        }
    return result


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}, Polars {pl.__version__}"


def report(result: dict, command: str) -> str:
    n = result["steps"]
    v = result["variants"]
    polars, python, floor = v["polars"], v["python"], v["floor"]
    lines = [
        f"steps: {n:,} (input {result['input_bytes'] / 2**20:.0f} MiB Parquet; output codec {result['compression']})",
        "| variant | wall time (min / median) | steps/s (min wall) | CPU time (min) | peak memory |",
        "|---|---|---|---|---|",
    ]
    for name, label in (
        ("polars", "Polars stage"),
        ("python", "per-group Python"),
        ("floor", "I/O floor"),
    ):
        r = v[name]
        note = f" (extrapolated from {r['steps_measured']:,} steps)" if name == "python" else ""
        lines.append(
            f"| {label}{note} | {r['seconds_min']:.2f} s / {r['seconds_median']:.2f} s | "
            f"{n / r['seconds_min']:,.0f} | {r['cpu_seconds_min']:.2f} s | {r['peak_gib']:.2f} GiB |"
        )
    load = result["load_average"]
    lines += [
        "",
        f"- diagnostics (`gagpo advantages` prints them after writing; not in the stage time): "
        f"{polars['diagnostics_seconds']:.2f} s",
        f"- Polars stage vs per-group Python: **{python['seconds_min'] / polars['seconds_min']:.1f}× faster** "
        f"in wall time, {python['cpu_seconds_min'] / polars['cpu_seconds_min']:.1f}× in CPU time (target ≥ 20×)",
        f"- Polars stage vs I/O floor: **{polars['seconds_min'] / floor['seconds_min']:.2f}× the floor** "
        f"in wall time, {polars['cpu_seconds_min'] / floor['cpu_seconds_min']:.2f}× in CPU time (target ≤ 2×)",
        f"- 1-minute load average before / after: {load[0]:.1f} / {load[1]:.1f} (2 cores; other jobs ran)",
        f"- command: `{command}`",
        f"- machine: {machine()}; date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1_000_000, help="synthetic steps (default 1M)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant (interleaved)")
    parser.add_argument(
        "--python-sample", type=int, default=100_000, help="steps the Python variant runs on"
    )
    parser.add_argument("--shuffled", action="store_true", help="store rows in random order")
    parser.add_argument("--compression", default="snappy", help="codec of the written tables")
    parser.add_argument(
        "--warm-gib", type=float, default=8.0, help="memory to touch once before measuring"
    )
    parser.add_argument(
        "--workdir", help="where inputs are generated and kept (default: a temp dir)"
    )
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON too")
    parser.add_argument("--child", choices=(*VARIANTS, "prepare"), help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--expected", help=argparse.SUPPRESS)
    parser.add_argument("--sample", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "prepare":
        generate(
            args.steps,
            Path(args.input),
            Path(args.expected),
            Path(args.sample),
            args.python_sample,
            args.shuffled,
        )
        return
    if args.child:
        child(args)
        return
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
    print(report(result, "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])))


if __name__ == "__main__":
    main()

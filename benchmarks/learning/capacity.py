"""Warm-start capacity: which policy size learns an environment from the same demonstrations.

The warm start (`gagpo warmstart`) of the 2-layer, 64-wide `tiny` policy learns sokoban only
with `describe` and stays at 0 % on household. This benchmark separates the model from the
data: the demonstrations are recorded once (with the `tiny` tokenizer, which every shape
here shares), then each shape — a random Llama of L layers × width W — is trained on the
same shards with the same SFT settings (`warmstart.supervised`) and evaluated like a warm
start (`warmstart.evaluate`: groups of 4 rollouts at temperature 1, the same task seeds).

    python benchmarks/learning/capacity.py --env household \\
        --options '{"room": "small", "goals": ["pick_place"]}' --shapes 2x64,4x256 \\
        --demos 2048 --out /tmp/capacity          # minutes per shape on a GPU, far more on 2 cores

Results: OUT/capacity.json and a table on stdout. The demonstrations stay in OUT/demos and are
reused by a second run with the same OUT (shapes already evaluated are skipped).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from gagpo.storage.store import Store
from gagpo.workflows.warmstart import (
    WarmstartConfig,
    evaluate,
    record_demonstrations,
    supervised,
)

INIT_SEED = 20261130


def parse_shape(text: str) -> tuple[int, int]:
    layers, _, width = text.lower().partition("x")
    if not (layers.isdigit() and width.isdigit() and int(width) % 32 == 0):
        raise SystemExit(
            f"shape {text!r} not accepted; accepted: LxW with W a multiple of 32, e.g. 4x256"
        )
    return int(layers), int(width)


def write_policy(layers: int, width: int, folder: Path) -> int:
    """A randomly initialised Llama of `layers` × `width` with the `tiny` tokenizer; returns
    its parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from gagpo.actors.policies.presets import quiet_transformers, resolve_model

    tiny = resolve_model("tiny")
    config = LlamaConfig.from_pretrained(tiny)  # tiny's, with another shape
    heads = max(4, width // 64)
    config.hidden_size, config.num_hidden_layers, config.intermediate_size = (
        width,
        layers,
        2 * width,
    )
    config.num_attention_heads = config.num_key_value_heads = heads
    config.head_dim = width // heads
    with torch.random.fork_rng(devices=[]), quiet_transformers():
        torch.manual_seed(INIT_SEED)
        model = LlamaForCausalLM(config)
        model.generation_config = LlamaForCausalLM.from_pretrained(tiny).generation_config
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def run_shape(cfg_json: str, shape: str, out: str, eval_groups: int) -> dict:
    """Train one shape on the recorded demonstrations and evaluate it (own process)."""
    cfg = WarmstartConfig.model_validate_json(cfg_json)
    layers, width = parse_shape(shape)
    folder = Path(out) / shape
    t0 = time.time()
    params = write_policy(layers, width, folder / "init")
    shape_cfg = cfg.model_copy(update={"policy": str(folder / "init")})
    summary, nll = supervised(shape_cfg, str(folder / "store"), replay=str(Path(out) / "demos"))
    t_sft = time.time() - t0
    policy = Store(str(folder / "store")).policies.dir(summary.version)
    result = evaluate(policy, shape_cfg, groups=eval_groups, store=str(folder / "eval"))
    return {
        "shape": shape,
        "parameters": params,
        "sft_updates": len(nll),
        "nll_first": nll[0],
        "nll_last": nll[-1],
        "sft_s": round(t_sft, 1),
        "eval_s": round(time.time() - t0 - t_sft, 1),
        **result,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="household")
    parser.add_argument("--options", default="{}", help="the environment's options, as JSON")
    parser.add_argument("--shapes", default="2x64,4x256", help="LxW, comma-separated")
    parser.add_argument("--demos", type=int, default=2048)
    parser.add_argument("--batch-groups", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-turns", type=int, default=15)
    parser.add_argument("--history-window", type=int, default=1)
    parser.add_argument("--eval-groups", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=1, help="shapes trained at once")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]  # none: only the demos
    for shape in shapes:
        parse_shape(shape)
    cfg = WarmstartConfig(
        env=args.env,
        env_options=json.loads(args.options),
        max_turns=args.max_turns,
        history_window=args.history_window,
        demos=args.demos,
        batch_groups=args.batch_groups,
        lr=args.lr,
    )
    out = Path(args.out)
    results_file = out / "capacity.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    if not (out / "demos" / "shards").exists():
        t0 = time.time()
        demos = record_demonstrations(cfg, str(out / "demos"))
        print(
            f"demonstrations: {demos.steps} steps, expert success {demos.success_rate:.1%} "
            f"({time.time() - t0:.0f} s)",
            flush=True,
        )
    todo = [s for s in shapes if s not in results]
    with ProcessPoolExecutor(max(1, args.jobs), mp_context=get_context("spawn")) as pool:
        futures = {
            s: pool.submit(run_shape, cfg.model_dump_json(), s, str(out), args.eval_groups)
            for s in todo
        }
        for shape, future in futures.items():
            results[shape] = future.result()
            results_file.write_text(json.dumps(results, indent=2) + "\n")
            r = results[shape]
            print(f"{shape}: done in {r['sft_s'] + r['eval_s']:.0f} s", flush=True)

    print(
        f"\n{cfg.env} {json.dumps(cfg.env_options)}: {cfg.demos} demos, "
        f"{cfg.updates} SFT updates (batch {cfg.batch_groups}, lr {cfg.lr})"
    )
    print("| shape | parameters | NLL per action token | eval success | eval valid replies |")
    print("|---|---|---|---|---|")
    for shape in shapes:
        r = results[shape]
        print(
            f"| {shape} | {r['parameters']:,} | {r['nll_first']:.3f} → {r['nll_last']:.3f} | "
            f"{r['success_rate']:.1%} | {r['valid_rate']:.1%} |"
        )


if __name__ == "__main__":
    main()

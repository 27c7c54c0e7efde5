"""What the learner's commit after each update costs, before and after issue 40.

    python benchmarks/bench_publish.py [--policy tiny --policy smollm2-135m --policy qwen2.5-0.5b-shape]

For each policy, on CPU, into a local store: the learner's own commit path
(`Trainer.take_version` → metrics → `Trainer.release_version`, then `Trainer.finish`) after each of N
simulated updates (an AdamW-like in-place change of the weights and both moments, so
that every version and state differs; not timed), in two settings:

    before  fp32 weights with every version, and the whole training state with every
            version, written on the critical path (`--state-every 1 --no-state-async
            --no-publish-async --publish-dtype fp32`: the learner as it was)
    after   the defaults when training bf16: bf16 weights copied to CPU memory and
            written by a thread (which then moves LATEST) while the next update runs;
            the state every 20 updates, copied and written by a thread likewise

An update's compute is simulated by `--update-s` seconds of sleep after the in-place
change (a GPU's update leaves the CPU free; the writer threads need that time to finish
before the next publication, which otherwise waits for them: that wait is counted).

Per update: the critical-path seconds (publish_s + state_s, as the metrics record them)
and the bytes written (the policy folders and states, the run's closing state
included), as bytes per parameter. `qwen2.5-0.5b-shape` is a random model of
Qwen2.5-0.5B's shape built here (nothing downloaded; it has no tokenizer files).
Memory: about 11 GiB for the 0.5B model (weights, moments, the state's copy).

The GPU check (benchmarks/gpu_check.sh) runs the "after" setting on CUDA with real bf16
updates for random models of Qwen2.5-1.5B's and 7B's shapes:

    python benchmarks/bench_publish.py --device cuda --train-tokens 512 --settings after \
        --after-updates 3 --policy qwen2.5-1.5b-shape --policy qwen2.5-7b-shape
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "before": {
        "state_every": 1,
        "state_async": False,
        "publish_async": False,
        "publish_dtype": "fp32",
    },
    "after": {
        "state_every": 20,
        "state_async": True,
        "publish_async": True,
        "publish_dtype": "auto",
    },
}


# Random models of Qwen2.5's shapes (hidden, intermediate, layers, heads, kv heads,
# vocabulary, tied embeddings), built where the benchmark runs: nothing is downloaded.
SHAPES = {
    "qwen2.5-0.5b-shape": (896, 4864, 24, 14, 2, 151936, True),  # 494M parameters
    "qwen2.5-1.5b-shape": (1536, 8960, 28, 12, 2, 151936, True),  # 1.54B
    "qwen2.5-7b-shape": (3584, 18944, 28, 28, 4, 152064, False),  # 7.6B
}


def shaped_model(name: str, folder: Path, device):
    """A randomly initialised model of `name`'s shape, on `device`; `folder` gets its
    config.json (the base folder holds no tokenizer: none is copied into versions)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[name]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=32768,
        tie_word_embeddings=tied,
        rope_theta=1_000_000.0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).float()
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return model


def load(policy: str, work: Path, device):
    from gagpo.actors.policies.presets import resolve_model
    from gagpo.learner.model import load_model

    if policy in SHAPES:
        base = work / "base"
        return shaped_model(policy, base, device), base
    base = Path(resolve_model(policy))
    return load_model(base, device), base


def fake_update(model, optimizer) -> None:
    """Changes weights and both moments in place, as an AdamW step does (untimed)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            state = optimizer.state[p]
            state["exp_avg"].mul_(0.9).add_(p, alpha=1e-4)
            state["exp_avg_sq"].mul_(0.999).add_(1e-8)
            state["step"] += 1
            p.add_(state["exp_avg"], alpha=-1e-5)


def first_step(model, optimizer) -> None:
    """One real AdamW step, so the optimiser holds its moments; the gradients are freed."""
    import torch

    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def real_update(model, optimizer, tokens: int) -> None:
    """A bf16 forward and backward over `tokens` random tokens, then an AdamW step."""
    import torch

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()


def disk_needed(params: int, setting: str) -> int:
    """Bytes a store of `setting` holds at its peak: 3 versions (2 kept, 1 being written)
    and 3 states (idem), a state being AdamW's two fp32 moments."""
    weights = 4 if SETTINGS[setting]["publish_dtype"] == "fp32" else 2
    return 3 * params * weights + 3 * params * 8


def run_setting(
    policy: str,
    setting: str,
    updates: int,
    work: Path,
    device: str = "cpu",
    train_tokens: int = 0,
    update_s: float = 0.0,
) -> dict:
    """`updates` commits in `setting`; between them the simulated update (lasting
    `update_s`), or with `train_tokens` a real one (timed apart: compute_s)."""
    import torch

    from gagpo.learner.config import LearnerConfig
    from gagpo.learner.dist import Dist
    from gagpo.learner.feed import TRAINED, GroupRef, Ledger
    from gagpo.learner.publish import Publisher, VersionCopy, take_weights
    from gagpo.learner.state import Head
    from gagpo.learner.train import Trainer, make_optimizer
    from gagpo.storage.store import Store

    model, base = load(policy, work, torch.device(device))
    params = sum(p.numel() for p in model.parameters())
    free = shutil.disk_usage(work).free
    if free < disk_needed(params, setting):
        need = disk_needed(params, setting) / 1e9
        return {
            "policy": policy,
            "setting": setting,
            "parameters": params,
            "skipped": f"needs {need:.0f} GB of disk, {free / 1e9:.0f} GB free",
        }
    model.train()
    if train_tokens:
        model.gradient_checkpointing_enable()  # the 7B shape's activations fit beside AdamW
    store_dir = work / f"store-{setting}"
    cfg = LearnerConfig(
        store=str(store_dir),
        policy=str(base),
        updates=updates,
        precision="bf16",  # "after" publishes bf16 through publish_dtype = auto
        keep_versions=2,
        keep_checkpoints=2,
        **SETTINGS[setting],
    )
    optimizer, scheduler = make_optimizer(model, cfg)
    first_step(model, optimizer)
    store = Store(cfg.store)
    parts = Trainer(
        cfg, Dist(0, 1, torch.device("cpu")), store, base, model, optimizer, scheduler, None
    )
    ledger = Ledger()  # a run's ledger: 1000 groups consumed
    refs = [GroupRef("run", f"s{i // 4}", f"g{i:08d}", 0, 4, 0.0) for i in range(1000)]
    ledger.record(refs, TRAINED, 1, 0)
    # Untimed: the first write pays one-time costs (imports, allocator) in either setting.
    dtype = parts.publish_dtype
    warm_up = Publisher(Store(str(work / "warm-up")), model, base, keep=1, asynchronous=False)
    warm_up.write(VersionCopy(1, 1, take_weights(model, dtype=dtype, copy=False), None, dtype))
    head, critical, compute, written = Head(0, 0, None), [], [], 0
    t_start = time.perf_counter()
    for update in range(1, updates + 1):
        t0 = time.perf_counter()
        if train_tokens:
            real_update(model, optimizer, train_tokens)
        else:
            fake_update(model, optimizer)
            time.sleep(max(0.0, update_s - (time.perf_counter() - t0)))
        compute.append(time.perf_counter() - t0)
        child, costs = parts.take_version(head, update, ledger, last=update == updates)
        parts.release_version(child)
        head = child
        critical.append(costs["publish_s"] + costs["state_s"])
        written += costs["bytes_written"]
    parts.finish(head, ledger)  # the last state finishes: its bytes count too
    written += parts.writer.take_bytes()
    wall = time.perf_counter() - t_start
    del model, optimizer, parts
    shutil.rmtree(store_dir, ignore_errors=True)
    return {
        "policy": policy,
        "setting": setting,
        "parameters": params,
        "updates": updates,
        "device": device,
        "compute_s_mean": statistics.mean(compute) if train_tokens or update_s else None,
        "critical_s_mean": statistics.mean(critical),
        "critical_s_median": statistics.median(critical),
        "critical_s_max": max(critical),
        "critical_s": critical,  # per update: the last one writes its version at once
        "bytes_per_update": written / updates,
        "bytes_per_parameter": written / updates / params,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", action="append", help="tiny, smollm2-135m, qwen2.5-0.5b-shape")
    parser.add_argument("--before-updates", type=int, default=3, help="the same every update")
    parser.add_argument("--after-updates", type=int, default=20)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--train-tokens",
        type=int,
        default=0,
        help="real bf16 updates over this many random tokens instead of the simulated ones",
    )
    parser.add_argument(
        "--settings", default="before,after", help="which settings, comma-separated"
    )
    parser.add_argument(
        "--update-s",
        type=float,
        default=0.0,
        help="seconds each simulated update lasts (its compute; the writer threads run meanwhile)",
    )
    args = parser.parse_args()
    policies = args.policy or ["tiny", "smollm2-135m", "qwen2.5-0.5b-shape"]
    unknown = [p for p in args.settings.split(",") if p not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; accepted: before, after")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    rows = []
    for policy in policies:
        pair = {}
        counts = {"before": args.before_updates, "after": args.after_updates}
        for setting in args.settings.split(","):
            with tempfile.TemporaryDirectory(prefix="gagpo-bench-publish-") as tmp:
                pair[setting] = run_setting(
                    policy,
                    setting,
                    counts[setting],
                    Path(tmp),
                    args.device,
                    args.train_tokens,
                    args.update_s,
                )
            print(json.dumps(pair[setting]), file=sys.stderr, flush=True)
        if len(pair) == 2 and not any("skipped" in r for r in pair.values()):
            ratio = pair["before"]["critical_s_mean"] / max(pair["after"]["critical_s_mean"], 1e-9)
            pair["after"]["critical_ratio"] = ratio
        rows += list(pair.values())
    print(
        "| policy | parameters | setting | updates | update compute s | critical path s/update "
        "(mean, max) | bytes/update | bytes/parameter | before/after |"
    )
    print("|---|---:|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        head = f"| {r['policy']} | {r['parameters'] / 1e6:.1f} M | {r['setting']} "
        if "skipped" in r:
            print(head + f"| skipped: {r['skipped']} | | | | | |")
            continue
        ratio = f"{r['critical_ratio']:.1f}×" if "critical_ratio" in r else ""
        compute = f"{r['compute_s_mean']:.2f}" if r["compute_s_mean"] is not None else "—"
        print(
            head + f"| {r['updates']} | {compute} "
            f"| {r['critical_s_mean']:.3f}, {r['critical_s_max']:.3f} "
            f"| {r['bytes_per_update'] / 2**20:.1f} MiB | {r['bytes_per_parameter']:.2f} | {ratio} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

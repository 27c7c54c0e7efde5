"""Delta publication on real training (issue 40): bytes of a delta version against the
full bf16 version, and what writing and applying one costs.

    OMP_NUM_THREADS=2 python benchmarks/bench_delta.py [--policy tiny --policy smollm2-135m]
        [--updates 20] [--every 10] [--json out.json]

For each policy, into a local store, every version is published in bf16 by the learner's
own writer and kept:

    tiny          the learner (`train()`, the real loop: advantages, the GAGPO update,
                  AdamW at the default lr 1e-5) on sokoban groups played by the actor
                  (`run_actor`, the tiny preset), one version per update
    smollm2-135m  the learner's AdamW (`make_optimizer`, lr 1e-5) stepping on the
                  language-model loss of a sokoban observation (`optimiser_run` says why
                  not the GAGPO update here)

Then the published versions are replayed through `DeltaPublisher` (what the learner runs
with `publish_delta_every = K`) into a second store: v1, vK, v2K… full, the others XOR
deltas of the version before. Per version: the bytes of the weights as published (full
or delta), the seconds to encode it (the publisher's thread), and, for an actor holding
the version before, the seconds to fetch it from the delta store (copy + apply into a
cache) against copying the full version.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def learner_run(store_root: Path, policy: str, updates: int, batch_groups: int) -> Path:
    """The tiny policy: actor-played sokoban groups, then `updates` updates of the learner
    (`train()`), every version published in bf16 and kept. Returns the base folder."""
    from gagpo.actors.actor import run_actor
    from gagpo.actors.policies.presets import resolve_model
    from gagpo.learner.config import LearnerConfig
    from gagpo.learner.train import train
    from tests.helpers.actors import actor_config

    base = resolve_model(policy)
    sokoban = {"sizes": [5, 5], "max_boxes": 1}
    groups = updates * batch_groups
    run_actor(
        actor_config(
            store_root, "sokoban", groups=groups, group_size=2, max_turns=3, env_options=sokoban
        )
    )
    cfg = LearnerConfig(
        store=str(store_root),
        policy=str(base),
        updates=updates,
        batch_groups=batch_groups,
        publish_dtype="bf16",
        keep_versions=updates + 5,
        state_every=10**6,
        max_staleness=10**6,
        idle_timeout_s=2.0,
        poll_interval_s=0.05,
    )
    t0 = time.perf_counter()
    summary = train(cfg)
    print(f"  learner: {summary.updates} updates in {time.perf_counter() - t0:.0f} s", flush=True)
    return base


def optimiser_run(store_root: Path, policy: str, updates: int, tokens: int) -> Path:
    """SmolLM2: the learner's AdamW (`make_optimizer`: lr 1e-5, its betas, eps and
    gradient clip) stepping on the gradient of the language-model loss of `tokens` tokens
    of a sokoban board's text, `updates` times; each version published in bf16 by the
    learner's own writer (`take_weights`, `Publisher`). The GAGPO update of `train()`
    took 110-160 s per update of 2 groups on this loaded 2-core VM: 20 of them would not
    fit a benchmark here. A consistent language-model gradient moves every weight by about
    lr each step, as AdamW does under any loss (|m/√v| ≤ 1): a noisier policy gradient
    moves fewer weights across bf16's rounding grid, so deltas there are no larger."""
    import torch

    from gagpo.actors.policies.presets import resolve_model
    from gagpo.envs import make_env
    from gagpo.learner.config import LearnerConfig
    from gagpo.learner.model import load_model
    from gagpo.learner.publish import Publisher, VersionCopy, take_weights
    from gagpo.learner.train import make_optimizer
    from gagpo.storage.store import Store

    base = resolve_model(policy)
    store = Store(str(store_root))
    store.policies.publish_base(str(base))
    cfg = LearnerConfig(store=str(store_root), policy=str(base), updates=updates)
    model = load_model(base, torch.device("cpu"))
    optimizer, scheduler = make_optimizer(model, cfg)
    from transformers import AutoTokenizer

    env = make_env("sokoban", 3, sizes=[5, 5], max_boxes=1)
    text = env.reset(0).observation  # a real observation the actors would prompt with
    ids = AutoTokenizer.from_pretrained(base)(text * 8, return_tensors="pt").input_ids
    ids = ids[:, :tokens]
    publisher = Publisher(store, model, base, keep=updates + 5, asynchronous=False)
    t0 = time.perf_counter()
    for version in range(1, updates + 1):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        weights = take_weights(model, dtype=torch.bfloat16)
        publisher.publish(VersionCopy(version, version, weights, None, torch.bfloat16))
        publisher.wait()
        store.policies.set_latest(version)
    print(f"  {updates} AdamW steps and publications in {time.perf_counter() - t0:.0f} s")
    return base


def weights_bytes(folder: Path) -> int:
    return sum(
        p.stat().st_size
        for p in folder.iterdir()
        if p.name.endswith(".safetensors") or p.name.endswith(".xor.zst")
    )


def replay(full_store: Path, delta_root: Path, updates: int, every: int) -> list[dict]:
    """Publish v1..v`updates` of `full_store` again through DeltaPublisher(every); measure."""
    from gagpo.learner.publish import put_folder
    from gagpo.storage.delta import DeltaPublisher
    from gagpo.storage.store import Store

    full, store = Store(str(full_store)), Store(str(delta_root))
    publisher = DeltaPublisher(every)
    rows = []
    cache = Path(tempfile.mkdtemp(prefix="gagpo-delta-cache-"))
    for version in range(1, updates + 1):
        source = Path(full.policies.dir(version))
        with tempfile.TemporaryDirectory(prefix="gagpo-bench-delta-") as tmp:
            folder = Path(tmp) / "v"
            shutil.copytree(source, folder, ignore=shutil.ignore_patterns(".*"))
            t0 = time.perf_counter()
            is_delta = publisher.encode(folder, version)
            encode_s = time.perf_counter() - t0
            put_folder(store, folder, store.policies.dir(version), phase="publish")
        store.policies.set_latest(version)
        # an actor holding v-1: copy the full version, against fetching (copy + apply) it
        t0 = time.perf_counter()
        shutil.copytree(source, cache / f"full-v{version}", ignore=shutil.ignore_patterns(".*"))
        copy_full_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fetched = Path(store.policies.fetch(version, str(cache)))
        fetch_s = time.perf_counter() - t0
        for name in (p.name for p in source.glob("*.safetensors")):
            assert (fetched / name).read_bytes() == (source / name).read_bytes(), name
        rows.append(
            {
                "version": version,
                "delta": is_delta,
                "full_bytes": weights_bytes(source),
                "published_bytes": weights_bytes(Path(store.policies.dir(version))),
                "encode_s": encode_s,
                "copy_full_s": copy_full_s,
                "fetch_s": fetch_s,
            }
        )
    shutil.rmtree(cache, ignore_errors=True)
    return rows


def report(policy: str, rows: list[dict]) -> dict:
    deltas = [r for r in rows if r["delta"]]
    ratio = [r["published_bytes"] / r["full_bytes"] for r in deltas]
    average = sum(r["published_bytes"] for r in rows) / sum(r["full_bytes"] for r in rows)
    summary = {
        "policy": policy,
        "versions": len(rows),
        "deltas": len(deltas),
        "full_mib": rows[-1]["full_bytes"] / 2**20,
        "delta_ratio_mean": statistics.mean(ratio) if ratio else None,
        "delta_ratio_max": max(ratio) if ratio else None,
        "bytes_ratio_all_versions": average,
        "encode_s_mean": statistics.mean(r["encode_s"] for r in deltas) if deltas else None,
        "fetch_delta_s_mean": statistics.mean(r["fetch_s"] for r in deltas) if deltas else None,
        "copy_full_s_mean": statistics.mean(r["copy_full_s"] for r in rows),
    }
    print(json.dumps(summary, indent=1), flush=True)
    for r in rows:
        print(
            f"  v{r['version']:<3} {'delta' if r['delta'] else 'full '} "
            f"{r['published_bytes'] / 2**20:8.2f} MiB of {r['full_bytes'] / 2**20:.2f} "
            f"({r['published_bytes'] / r['full_bytes']:.3f})  encode {r['encode_s']:.2f} s  "
            f"fetch {r['fetch_s']:.2f} s  copy full {r['copy_full_s']:.2f} s",
            flush=True,
        )
    return {"summary": summary, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", action="append", choices=["tiny", "smollm2-135m"])
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--every", type=int, default=10, help="K: a full version every K")
    parser.add_argument("--batch-groups", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="smollm2: LM-loss tokens")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for policy in args.policy or ["tiny", "smollm2-135m"]:
        print(f"{policy}:", flush=True)
        with tempfile.TemporaryDirectory(prefix="gagpo-bench-delta-") as tmp:
            if policy == "tiny":
                learner_run(Path(tmp) / "full", policy, args.updates, args.batch_groups)
            else:
                optimiser_run(Path(tmp) / "full", policy, args.updates, args.tokens)
            rows = replay(Path(tmp) / "full", Path(tmp) / "delta", args.updates, args.every)
            results.append(report(policy, rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

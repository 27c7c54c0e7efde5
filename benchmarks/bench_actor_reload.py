"""What a policy version change costs an actor (issue 40, the actor side).

    python benchmarks/bench_actor_reload.py [--policy smollm2-135m] [--versions 4] [--every 6]

An actor (transformers backend, CPU) rolls out small sokoban groups into an object store
(a moto S3 server on loopback, so a version is really downloaded), while a publisher
thread publishes a new version every `--every` seconds (the policy's weights in bf16, as
the learner publishes them when it trains bf16; the newest two kept, as a learner's
pruning would). Per version the actor loads it prints what the actor recorded
(ActorSummary.loads):

    fetch_s   the download into the local cache, in the background while generating
    drain_s   finishing the replies in the engine (none on the transformers backend)
    load_s    building the engine on the new weights
    pause_s   drain_s + load_s: the time no reply is started

and `before_s` = fetch_s + drain_s + load_s, what the engine idled per version before
issue 40 (drain, then download, then load). The run stops once the last version is
loaded. Memory: the moto server holds the kept versions (about 270 MB each for
smollm2-135m in bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers: the one moto server of the tests


def bf16_copy(src: Path, dst: Path) -> Path:
    """`src`'s files with its safetensors weights cast to bf16 (what a bf16 learner publishes)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".*"))
    for path in dst.glob("*.safetensors"):
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return dst


def publisher(store, folder: Path, versions: int, every: float, done: threading.Event, log):
    """Publish `folder` as v1..v`versions`, one every `every` seconds once the actor has
    published v0, keeping the newest two (a learner's pruning)."""
    from gagpo.learner.publish import put_folder

    while not store.policies.has(0) and not done.is_set():
        time.sleep(0.5)
    for version in range(1, versions + 1):
        if done.wait(every):
            return
        t0 = time.perf_counter()
        put_folder(store, folder, store.policies.dir(version), phase="publish")
        store.policies.set_latest(version)
        log.append({"version": version, "publish_s": time.perf_counter() - t0})
        if version >= 3:
            store.remove(store.policies.dir(version - 2), recursive=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="smollm2-135m")
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--every", type=float, default=6.0, help="seconds between versions")
    parser.add_argument(
        "--limit", type=float, default=180, help="seconds past the last publication to stop"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the actor")
    args = parser.parse_args()

    from gagpo.actors.actor import run_actor
    from gagpo.actors.config import ActorConfig
    from gagpo.actors.policies.presets import load_policy
    from gagpo.storage.store import Store
    from tests.helpers.s3 import start_s3

    server, _ = start_s3("bench")
    scratch = Path(tempfile.mkdtemp(prefix="bench-actor-reload-"))
    done = threading.Event()
    try:
        config = ActorConfig(
            store="s3://bench/reload",
            env="sokoban",
            env_options={"sizes": [5, 5], "max_boxes": 1},
            policy=args.policy,
            backend="transformers",
            groups=10_000,  # stopped once the last version is loaded
            group_size=2,
            max_turns=2,
            seed=0,
            threads=args.threads,
        )
        policy = load_policy(
            args.policy, version=0, sampling=config.sampling, backend="transformers"
        )
        folder = bf16_copy(Path(policy.model_dir), scratch / "version")
        # Fetched versions go to a scratch cache (the preset above stays in the user's).
        os.environ["GAGPO_CACHE"] = str(scratch / "cache")
        store, published = Store(config.store, skip_instance_cache=True), []
        thread = threading.Thread(
            target=publisher, args=(store, folder, args.versions, args.every, done, published)
        )
        thread.start()

        t0 = time.perf_counter()
        deadline = t0 + args.versions * args.every + args.limit

        def progress(summary) -> None:
            last = summary.loads[-1].version if summary.loads else 0
            if last >= args.versions or time.perf_counter() > deadline:
                os.kill(os.getpid(), signal.SIGINT)  # the actor finishes its group and stops

        summary = run_actor(config, progress=progress, policy=policy)
        wall = time.perf_counter() - t0
    finally:
        done.set()
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    report(args, summary, published, wall)


def report(args, summary, published, wall: float) -> None:
    rows = [
        {
            "version": x.version,
            "fetch_s": round(x.fetch_s, 2),
            "drain_s": round(x.drain_s, 3),
            "load_s": round(x.load_s, 2),
            "pause_s": round(x.pause_s, 2),
            "before_s": round(x.fetch_s + x.pause_s, 2),
        }
        for x in summary.loads
    ]
    print(
        f"{args.policy}: {summary.groups} groups in {wall:.0f}s, versions played "
        f"{sorted(summary.versions)}; a version published every {args.every:g}s"
    )
    print(
        "| version | fetch s (overlapped) | drain s | load s | engine pause s | before: pause s |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| v{r['version']} | {r['fetch_s']:.2f} | {r['drain_s']:.3f} | {r['load_s']:.2f} "
            f"| {r['pause_s']:.2f} | {r['before_s']:.2f} |"
        )
    if rows:
        print(
            f"mean pause {statistics.mean(r['pause_s'] for r in rows):.2f}s against "
            f"{statistics.mean(r['before_s'] for r in rows):.2f}s before"
        )
    print(json.dumps({"loads": rows, "published": published}), file=sys.stderr)


if __name__ == "__main__":
    main()

"""What one lineage costs: the training state written with every published version.

    python benchmarks/faults/bench_state.py --policy tiny --policy smollm2-135m [--store s3]

For each policy: one AdamW step (so the optimiser holds its moments), then, into a store
(a local folder, or S3 on a moto server on loopback), `repeats` times: the version's
training state (learner/checkpoints/v<N>/: optimiser, scheduler, RNG, ledger) and its
policy folder (policy/v<N>/), timed separately, with their sizes. The ratio state /
publication is the overhead of a state with every version (state_every = 1) over
publishing alone. Both are written as the learner writes them on its own time
(state_async = publish_async = false): a `StateWriter` and a `Publisher`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "faults"))
sys.path.insert(0, str(ROOT))  # tests.helpers


def _folder_bytes(store, folder: str) -> int:
    return sum(info["size"] for info in store.fs.find(folder, detail=True).values())


def measure(policy: str, url: str, repeats: int, groups: int) -> dict:
    import torch

    from gagpo.actors.policies.presets import resolve_model
    from gagpo.learner.feed import TRAINED, GroupRef, Ledger
    from gagpo.learner.model import load_model
    from gagpo.learner.state import Head, StateWriter, checkpoint_dir, snapshot_state
    from gagpo.storage.store import Store
    from tests.helpers.publication import publish

    torch.manual_seed(0)
    base = resolve_model(policy)
    model = load_model(base, torch.device("cpu")).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ids = torch.randint(3, 100, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ledger = Ledger()  # a ledger of a long run: `groups` consumed groups
    refs = [GroupRef("run", f"s{i // 4}", f"g{i:08d}", 0, 4, 0.0) for i in range(groups)]
    ledger.record(refs, TRAINED, 1, 0)

    store = Store(url)
    head = Head(0, 0, None)
    writer = StateWriter(store, keep=repeats, asynchronous=False)
    state_s, publish_s = [], []
    for _ in range(repeats):
        child = head.child(head.update + 1)
        t0 = time.perf_counter()
        record = child.record(head)
        writer.save(
            snapshot_state(
                store,
                child.version,
                record,
                model,
                optimizer,
                scheduler,
                ledger,
                copy_tensors=False,
            )
        )
        t1 = time.perf_counter()
        publish(store, model, base, child.version, keep=2, lineage=record)
        t2 = time.perf_counter()
        state_s.append(t1 - t0)
        publish_s.append(t2 - t1)
        head = child
    params = sum(p.numel() for p in model.parameters())
    return {
        "policy": policy,
        "store": "s3" if url.startswith("s3://") else "local",
        "parameters": params,
        "state_bytes": _folder_bytes(store, checkpoint_dir(store, head.version)),
        "policy_bytes": _folder_bytes(store, store.policies.dir(head.version)),
        "state_s": statistics.median(state_s),
        "publish_s": statistics.median(publish_s),
        "ledger_groups": groups,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", action="append", help="tiny, smollm2-135m (repeatable)")
    parser.add_argument("--store", choices=["local", "s3"], default="local")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, default=10_000, help="ledger rows in each state")
    args = parser.parse_args()
    torch_threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    import torch

    torch.set_num_threads(torch_threads)
    server = None
    if args.store == "s3":
        from run_faults import start_s3

        server = start_s3()
    try:
        for policy in args.policy or ["tiny"]:
            with tempfile.TemporaryDirectory(prefix="gagpo-bench-state-") as tmp:
                url = f"s3://gagpo-faults/bench-{policy}" if server else str(Path(tmp) / "store")
                r = measure(policy, url, args.repeats, args.groups)
            print(
                f"{r['policy']:>14} ({r['parameters'] / 1e6:.1f}M params, {r['store']}): state "
                f"{r['state_bytes'] / 2**20:.1f} MiB in {r['state_s']:.2f}s, publication "
                f"{r['policy_bytes'] / 2**20:.1f} MiB in {r['publish_s']:.2f}s; state/publication "
                f"{r['state_s'] / r['publish_s']:.2f}× time, "
                f"{r['state_bytes'] / r['policy_bytes']:.2f}× bytes "
                f"(ledger of {r['ledger_groups']} groups)"
            )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

"""SIGKILL `gagpo compact` at random instants, many times; count what survived.

    python benchmarks/faults/compaction_kills.py --kills 20 --shards 300

Each round copies one store of real-shaped shards (tests' factory, with per-shard
advantage tables and a ledger for half of them), starts `gagpo compact --all` on the
copy, kills it after a random delay within the compaction's own duration (measured
first), then runs `gagpo compact --all` again. A round survives when afterwards:
every group is read exactly once with the rows it had (storage/archive.py), each ledger
row once, every file of archive/ is named by the newest manifest, no shard the manifest
moved is left in the inbox, every advantage table belongs to a live file, and no
temporary file is left. Prints one line per round and the count.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
GAGPO = str(Path(sys.executable).with_name("gagpo"))


def build(store_dir: Path, shards: int) -> None:
    from gagpo.schemas import columns as C
    from gagpo.schemas import layout
    from gagpo.storage.store import Store
    from tests.helpers.steps import make_steps

    store = Store(str(store_dir))
    rows = []
    for i in range(shards):
        shard_id = f"s{i:05d}"
        table = make_steps(run_id=f"r{i % 3}", shard_id=shard_id, groups=1 + i % 2, group_size=3)
        store.write_shard(table, group_size=3)
        if i % 2 == 0:  # half of them consumed by a "learner" at update 1
            for g in table[C.GROUP_ID].unique().to_pylist():
                rows.append(
                    {
                        C.RUN_ID: f"r{i % 3}",
                        C.SHARD_ID: shard_id,
                        C.GROUP_ID: g,
                        C.SHARD_GROUPS: 1 + i % 2,
                        C.POLICY_VERSION: 0,
                        C.LEDGER_UPDATE: 1,
                        C.LEDGER_LEARNER_VERSION: 0,
                        C.LEDGER_STATUS: "trained",
                    }
                )
    store.write_parquet(
        pa.Table.from_pylist(rows, schema=C.LEDGER_SCHEMA), layout.ledger(store.root), {}
    )
    from gagpo.pipeline.config import GagpoConfig
    from gagpo.pipeline.recompute import recompute_store

    recompute_store(str(store_dir), None, GagpoConfig())


def snapshot(store_dir: Path) -> tuple[pa.Table, int]:
    from gagpo.schemas import columns as C
    from gagpo.storage.archive import read_ledger, read_steps_table
    from gagpo.storage.store import Store

    store = Store(str(store_dir))
    steps = read_steps_table(store, [C.GROUP_ID, C.TRAJ_ID, C.STEP, C.REWARD])
    steps = steps.take(pc.sort_indices(steps, [(C.TRAJ_ID, "ascending"), (C.STEP, "ascending")]))
    return steps, read_ledger(store).num_rows


def problems(store_dir: Path, before: pa.Table, ledger_rows: int) -> list[str]:
    from gagpo.storage.archive import moved_by, read_manifest, step_files
    from gagpo.storage.store import Store

    store = Store(str(store_dir))
    out = []
    after, rows = snapshot(store_dir)
    if not after.equals(before):
        out.append(f"steps differ ({before.num_rows} rows before, {after.num_rows} after)")
    if rows != ledger_rows:
        out.append(f"ledger rows {ledger_rows} before, {rows} after")
    manifest = read_manifest(store)
    named = {s.id for s in manifest.segments} if manifest else set()
    for folder in ("segments", "ledger"):
        for path in (store_dir / "archive" / folder).glob("*"):
            if path.name.startswith(".") or path.stem not in named:
                out.append(f"archive/{folder}/{path.name} not named by the manifest")
    files = step_files(store)
    if manifest and {r.shard_id for r in files.shards} & moved_by(store, manifest):
        out.append("a moved shard is still in the inbox")
    alive = set(files.ids())
    for path in (store_dir / "advantages").rglob("*"):
        if path.is_file() and (path.name.startswith(".") or path.stem not in alive):
            out.append(f"advantages/{path.parent.name}/{path.name} belongs to no file")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--shards", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = dict(os.environ, GAGPO_LEASE_TTL_S="2")
    with tempfile.TemporaryDirectory(prefix="gagpo-kills-") as tmp:
        base = Path(tmp) / "base"
        build(base, args.shards)
        before, ledger_rows = snapshot(base)
        probe = Path(tmp) / "probe"
        shutil.copytree(base, probe)
        t0 = time.perf_counter()
        subprocess.run(
            [GAGPO, "compact", "--store", str(probe), "--all"],
            env=env,
            check=True,
            capture_output=True,
        )
        duration = time.perf_counter() - t0
        print(f"{args.shards} shards; an uninterrupted compaction takes {duration:.1f} s")
        survived = 0
        for k in range(args.kills):
            store = Path(tmp) / f"round{k}"
            shutil.copytree(base, store)
            delay = rng.uniform(0.0, duration)
            proc = subprocess.Popen(
                [GAGPO, "compact", "--store", str(store), "--all"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(delay)
            finished = proc.poll() is not None
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            again = subprocess.run(
                [GAGPO, "compact", "--store", str(store), "--all"],
                env=env,
                capture_output=True,
                text=True,
            )
            found = (
                []
                if again.returncode == 0
                else [f"the next compaction failed: {again.stderr.strip()}"]
            )
            found += problems(store, before, ledger_rows)
            survived += not found
            recovered = next((ln for ln in again.stdout.splitlines() if "removed" in ln), "")
            print(
                f"round {k + 1}: killed after {delay:.2f} s{' (it had finished)' if finished else ''}; "
                f"{'survived' if not found else 'LOST: ' + '; '.join(found[:3])}"
                f"{'  [' + recovered.split('; ')[-1] + ']' if recovered else ''}"
            )
            shutil.rmtree(store, ignore_errors=True)
        print(f"{survived} of {args.kills} rounds survived")
        sys.exit(0 if survived == args.kills else 1)


if __name__ == "__main__":
    main()

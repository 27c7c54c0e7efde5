"""The fault cases of issue 21, run by `run_faults.py --cases race,outage,full-disk`:

- race: two learners started together with --resume on one store (a lease each would
  try to take); one trains, the other stops with one line. Counts trials where both
  trained, groups trained twice and versions published twice.
- outage: the S3 endpoint (moto on loopback) goes away for `outage_s` (< the retry
  bound) every `period_s` while a learner runs, so that outages fall in every phase of
  its updates (listing, backward, ledger, metrics, histograms, checkpoint, publication);
  the learner must finish with one lineage.
- full-disk: a small tmpfs (root only; skipped otherwise) filled up during an actor's
  commit and during the learner's publications: exit 2 with one line, no temporary
  left, no partial version folder, LATEST a complete version.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _run(module: str, *args: str, env: dict | None = None, timeout: float = 600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _actors(store: str, groups: int, *extra: str, env: dict | None = None):
    return _run(
        "gagpo.actors.cli",
        "--store",
        store,
        "--policy",
        "tiny",
        "--env",
        "sokoban",
        "--groups",
        str(groups),
        "--group-size",
        "2",
        "--max-turns",
        "2",
        "--groups-per-shard",
        "1",
        "--quiet",
        *extra,
        env=env,
    )


def _learner_args(store: str, updates: int, *extra: str) -> list[str]:
    return [
        "-m",
        "gagpo.learner.cli",
        "--store",
        store,
        "--policy",
        "tiny",
        "--updates",
        str(updates),
        "--batch-groups",
        "1",
        "--max-staleness",
        "1000",
        "--keep-versions",
        "1000",
        "--poll-interval",
        "0.05",
        "--idle-timeout",
        "20",
        "--quiet",
        *extra,
    ]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line]


def _temporaries(folder: Path) -> int:
    return sum(1 for _ in folder.rglob(".tmp-*"))


def race(work: Path, trials: int = 3, updates: int = 4) -> dict:
    from gagpo.learner.checkpoint import check_lineage
    from gagpo.learner.feed import Ledger
    from gagpo.storage.store import Store

    out = {
        "trials": trials,
        "both_trained": 0,
        "one_refused_one_line": 0,
        "groups_trained_twice": 0,
        "lineage_problems": 0,
        "latest_ok": 0,
    }
    for trial in range(trials):
        store = str(work / f"race-{trial}")
        assert _actors(store, updates).returncode == 0
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GAGPO_LEASE_TTL_S": "6"}
        command = [sys.executable, *_learner_args(store, updates, "--resume")]
        procs = [
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        results = [(p.wait(timeout=600), p.communicate()[1]) for p in procs]
        codes = sorted(code for code, _ in results)
        out["both_trained"] += codes == [0, 0]
        refused = [err for code, err in results if code == 2]
        out["one_refused_one_line"] += (
            codes == [0, 2] and len(_error_lines(refused[0])) == 1 and "leased by" in refused[0]
        )
        s = Store(store)
        rows = Ledger.load(s).table().to_pylist()
        out["groups_trained_twice"] += len(rows) - len({r["group_id"] for r in rows})
        out["lineage_problems"] += len(check_lineage(s))
        out["latest_ok"] += s.policies.latest() == updates
    return out


def outage(
    work: Path,
    updates: int = 6,
    outage_s: float = 2.0,
    period_s: float = 4.0,
    bound_s: float = 60.0,
) -> dict:
    import logging

    import boto3

    from gagpo.learner.checkpoint import check_lineage
    from gagpo.storage.store import Store

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from tests.helpers.s3 import Emulator  # moto on a loopback port that can restart

    endpoint = Emulator()
    endpoint.start()
    os.environ.update(
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_ENDPOINT_URL=endpoint.endpoint,
        AWS_DEFAULT_REGION="us-east-1",
    )
    boto3.client("s3", endpoint_url=endpoint.endpoint).create_bucket(Bucket="outage")
    url = f"s3://outage/{work.name}-{int(time.time())}"
    env = {"AWS_MAX_ATTEMPTS": "1", "GAGPO_STORE_RETRY_S": str(bound_s)}
    assert _actors(url, updates, env=env).returncode == 0
    stop, outages, down_s = threading.Event(), [0], [0.0]

    def flap() -> None:
        while not stop.wait(period_s - outage_s):
            endpoint.stop()
            outages[0] += 1
            time.sleep(outage_s)
            down_s[0] += outage_s
            endpoint.start()

    flapper = threading.Thread(target=flap, daemon=True)
    t0 = time.monotonic()
    flapper.start()
    done = _run(*_learner_args(url, updates)[1:], env=env)
    stop.set()
    flapper.join()
    store = Store(url)
    retried = [line for line in done.stderr.splitlines() if "retry" in line]
    kinds = {
        k: sum(k in line for line in retried)
        for k in ("histograms.zarr", ".complete", "LATEST", "ledger", "lease", "shards")
    }
    result = {
        "outages": outages[0],
        "down_s": down_s[0],
        "outage_s": outage_s,
        "bound_s": bound_s,
        "learner_exit": done.returncode,
        "updates": updates,
        "latest": store.policies.latest(),
        "lineage_problems": len(check_lineage(store)),
        "retry_lines": len(retried),
        "retries_by_path": kinds,
        "seconds": round(time.monotonic() - t0, 1),
    }
    if done.returncode:
        result["error"] = (_error_lines(done.stderr) or [done.stderr[-300:]])[-1]
    endpoint.stop()
    return result


def _mount(folder: Path, size: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True,
        ).returncode
        == 0
    )


def full_disk(work: Path) -> dict:
    from gagpo.storage.store import Store

    out: dict = {}
    disk = work / "disk-actor"
    if not _mount(disk, "3m"):
        return {"skipped": "cannot mount a tmpfs (needs root)"}
    try:
        store = str(disk / "store")
        first = _actors(store, 1)
        shards_before = len(Store(store).list_shards())
        with open(disk / "ballast", "wb") as handle:  # leave ~16 KiB
            stat = os.statvfs(disk)
            with contextlib.suppress(OSError):
                handle.write(b"\0" * (stat.f_bavail * stat.f_frsize - (16 << 10)))
        full = _actors(store, 40)
        lines = _error_lines(full.stderr)
        s = Store(store)
        out["actor"] = {
            "first_exit": first.returncode,
            "exit": full.returncode,
            "one_line": len(lines) == 1 and "Traceback" not in full.stderr,
            "line": lines[-1][:300] if lines else full.stderr[-300:],
            "temporaries_left": _temporaries(disk),
            "shards_before": shards_before,
            "shards_after": len(s.list_shards()),
            "quarantined": len(s.quarantined()),
            "v0_complete": 0 in s.policies.stored(),
        }
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    disk = work / "disk-learner"
    if not _mount(disk, "6m"):
        return out
    try:
        store = str(disk / "store")
        _actors(store, 20)
        done = _run(*_learner_args(store, 20)[1:])
        lines = _error_lines(done.stderr)
        s = Store(store)
        latest, complete = s.policies.latest(), s.policies.stored()
        out["learner"] = {
            "exit": done.returncode,
            "one_line": len(lines) == 1 and "Traceback" not in done.stderr,
            "line": lines[-1][:300] if lines else done.stderr[-300:],
            "latest": latest,
            "latest_complete": latest in complete,
            "partial_version_folders": len(set(s.policies.folders()) - set(complete)),
            "temporaries_left": _temporaries(disk),
        }
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    return out


CASES = {"race": race, "outage": outage, "full-disk": full_disk}


def _round4():
    from round4 import CASES as ROUND4  # issue 33: node loss, Ctrl-C and SIGTERM

    return ROUND4


CASES |= _round4()

"""One learner per store (issue 21, item 1): two learners, resumed or not, never both
train on one store; a killed learner's lease expires; a learner that lost its lease
stops before it publishes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gagpo.learner import lease as L
from gagpo.learner.lease import LeaseLostError, acquire, check_lease, newest, release_lease
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from tests.helpers.learner import ROOT, learner_cmd, tiny_learner_args, write_shards

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TTL = 0.6  # seconds; renewals every 0.1 s


@pytest.fixture(autouse=True)
def _no_leases_left():
    yield
    for held in list(L._held.values()):
        held.release()


def _foreign(store: Store, generation: int, **fields) -> None:
    """A lease record written by another learner (another host unless said)."""
    record = {
        "token": "other",
        "host": "elsewhere",
        "pid": 1,
        "renewed_at": time.time(),
        "ttl_s": TTL,
        "released": False,
        **fields,
    }
    assert store.create_exclusive(layout.lease(store.root, generation), json.dumps(record).encode())


def test_second_learner_is_refused_while_the_first_renews(tmp_path):
    store = Store(str(tmp_path / "s"))
    first = acquire(store, ttl_s=TTL)
    start = time.monotonic()
    with pytest.raises(GagpoError) as info:
        _acquire_as_other_process(store)
    assert time.monotonic() - start < TTL  # refused on the first renewal it sees
    assert "leased by the learner with pid" in str(info.value) and "\n" not in str(info.value)
    first.check()  # the holder keeps it


def _acquire_as_other_process(store: Store):
    """Acquire as if from another process of this host: this process's own lease is
    neither reused nor taken for a dead process's."""
    held, dead_here = L._held.pop(store.url), L._dead_here
    L._dead_here = lambda record: False
    try:
        return acquire(store, ttl_s=TTL)
    finally:
        L._held[store.url], L._dead_here = held, dead_here


def test_lease_of_a_killed_learner_on_another_host_expires_after_ttl(tmp_path):
    store = Store(str(tmp_path / "s"))
    _foreign(store, 1, renewed_at=time.time() - 3600)  # never renewed again: killed
    start = time.monotonic()
    lease = acquire(store, ttl_s=TTL)
    assert TTL <= time.monotonic() - start < TTL + 1.0
    assert lease.generation == 2 and newest(store)[1]["token"] == lease.token


def test_lease_of_a_dead_process_on_this_host_is_free_at_once(tmp_path):
    import socket

    store = Store(str(tmp_path / "s"))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    _foreign(store, 1, host=socket.gethostname(), pid=int(dead.stdout))
    start = time.monotonic()
    acquire(store, ttl_s=60)
    assert time.monotonic() - start < 1.0


def test_released_lease_is_free_at_once(tmp_path):
    store = Store(str(tmp_path / "s"))
    acquire(store, ttl_s=60)
    release_lease(store)
    assert newest(store)[1]["released"] is True
    start = time.monotonic()
    assert acquire(store, ttl_s=60).generation == 2
    assert time.monotonic() - start < 1.0


def test_a_learner_that_lost_its_lease_stops_before_publishing(tmp_path):
    store = Store(str(tmp_path / "s"))
    lease = acquire(store, ttl_s=TTL)
    _foreign(store, lease.generation + 1)  # another learner took over
    with pytest.raises(LeaseLostError, match="lost its lease"):
        check_lease(store)


def test_publication_checks_the_lease_before_latest(tmp_path, monkeypatch):
    from gagpo.learner import publish
    from tests.helpers import publication

    store = Store(str(tmp_path / "s"))
    lease = acquire(store, ttl_s=TTL)
    store.policies.set_latest(3)
    _foreign(store, lease.generation + 1)
    monkeypatch.setattr(publish, "put_folder", lambda *a, **k: None)
    monkeypatch.setattr(publish, "copy_tokenizer_files", lambda *a, **k: None)

    class Model:
        def save_pretrained(self, folder, state_dict=None):
            pass

    monkeypatch.setattr("gagpo.learner.model.lora_modules", lambda model: [])
    with pytest.raises(LeaseLostError):
        publication.publish(store, Model(), tmp_path, 4, keep=10)
    assert store.policies.latest() == 3  # LATEST never moved


def test_renewals_lapsing_past_ttl_stop_publication(tmp_path):
    store = Store(str(tmp_path / "s"))
    lease = acquire(store, ttl_s=TTL)
    lease._stop.set()  # the heartbeat stops (a store away for longer than the ttl)
    time.sleep(TTL + 0.2)
    with pytest.raises(LeaseLostError, match="could not renew"):
        lease.check()


def test_exclusive_create_has_one_winner_on_s3(s3_endpoint, tmp_path):
    store = Store(f"s3://gagpo/{tmp_path.name}")
    path = store.path("learner", "lease", "00000001.json")
    assert store.create_exclusive(path, b"a") is True
    assert store.create_exclusive(path, b"b") is False
    assert store.read_bytes(path) == b"a"


def test_lease_on_s3_refuses_a_second_learner(s3_endpoint, tmp_path):
    store = Store(f"s3://gagpo/{tmp_path.name}")
    acquire(store, ttl_s=1.2)
    with pytest.raises(GagpoError, match="leased by"):
        _acquire_as_other_process(store)


def _args(store: Path, *extra: str) -> list[str]:
    options = {"micro_batch_tokens": 96, "keep_versions": 100, "idle_timeout": 20}
    return tiny_learner_args(store, *extra, updates=5, batch_groups=1, **options)


@pytest.mark.slow
def test_two_resumed_learners_never_train_the_same_groups(tmp_path):
    """The issue's probe: both started with --resume on one store. One trains; the other
    stops with one line and exit 2; every group is trained once, every version once."""
    from gagpo.learner.feed import Ledger

    store_dir = tmp_path / "store"
    store = Store(str(store_dir))
    # 3 of the 5 groups first: the learner that wins the lease waits for the rest (idle
    # timeout 180 s) and holds it, so the two overlap however slowly the loser starts.
    write_shards(store, 3, groups=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GAGPO_LEASE_TTL_S": "6"}
    command = learner_cmd(*_args(store_dir, "--resume"), "--idle-timeout", "180")
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(command, cwd=ROOT, env=env, **pipes) for _ in range(2)]
    deadline = time.monotonic() + 240
    while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)  # until one of them stops (refused)
    write_shards(store, 2, groups=1, prefix="t")
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    [(_, _, refused)] = [r for r in results if r[0] == 2]
    lines = [line for line in refused.splitlines() if "error" in line]
    assert len(lines) == 1 and "leased by" in lines[0] and "Traceback" not in refused
    ledger = Ledger.load(store).table().to_pylist()
    assert len(ledger) == 5 and len({row["group_id"] for row in ledger}) == 5
    assert store.policies.latest() == 5

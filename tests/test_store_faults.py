"""Object-store faults (issue 14, cases 2 and 7) against an S3 emulator (moto) on loopback:
listings that see what other processes add, outages shorter and longer than the retry
bound, and one line (exit code 2) from every command when the store does not answer."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gagpo.actors.config import ActorConfig
from gagpo.schemas.errors import StoreUnavailableError, is_transient
from gagpo.storage.retry import retrying
from gagpo.storage.store import Store
from tests.helpers.s3 import free_port
from tests.helpers.steps import make_steps

ROOT = Path(__file__).resolve().parents[1]
WRITER = """
import sys, time
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps
store = Store(sys.argv[1])
for i in range(3):
    store.write_shard(make_steps(shard_id=f"{sys.argv[2]}{i}"), group_size=3)
    time.sleep(0.3)
"""


def test_polling_store_sees_shards_two_processes_add(s3_endpoint, tmp_path):
    """The learner sat at update 13 of 16 while 1,146 shards waited: its listing came from
    the cache of an earlier one. Here a Store polls in a loop while two processes write."""
    url = f"s3://gagpo/{tmp_path.name}"
    poller = Store(url)
    poller.write_shard(make_steps(shard_id="a0"), group_size=3)
    assert [r.shard_id for r in poller.list_shards()] == ["a0"]  # the run folder is listed
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, url, prefix], cwd=ROOT)
        for prefix in ("b", "c")
    ]
    try:
        seen: list[str] = []
        deadline = time.monotonic() + 120
        while len(seen) < 7 and time.monotonic() < deadline:
            seen = [r.shard_id for r in poller.list_shards("run1")]
            time.sleep(0.1)
        assert [w.wait(timeout=120) for w in writers] == [0, 0]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
    assert seen == ["a0", "b0", "b1", "b2", "c0", "c1", "c2"]


# --- outages ----------------------------------------------------------------------
def actor_config(url: str, retry_s: float) -> ActorConfig:
    """Three groups in one shard: the first two wait in memory while the store is away."""
    return ActorConfig(
        store=url,
        env="sokoban",
        policy="tiny",
        groups=3,
        group_size=2,
        max_turns=2,
        groups_per_shard=3,
        seed=5,
        store_retry_s=retry_s,
    )


def test_actor_commits_after_an_outage_shorter_than_the_bound(emulator, tmp_path, caplog):
    from gagpo.actors.actor import run_actor

    url = f"s3://outage/{tmp_path.name}"

    def outage_after_first_group(summary) -> None:
        if summary.groups == 1:
            emulator.stop()
            threading.Timer(3.0, emulator.start).start()

    with caplog.at_level(logging.WARNING, logger="gagpo.store"):
        summary = run_actor(actor_config(url, 120), progress=outage_after_first_group)
    retries = [r.getMessage() for r in caplog.records if r.name == "gagpo.store"]
    assert retries and all("\n" not in line and "retry" in line for line in retries)
    assert summary.groups == 3 and len(summary.shards) == 1
    store = Store(url)
    [ref] = store.list_shards()
    table = store.read_shard(ref)  # whole and valid
    assert len(set(table.column("group_id").to_pylist())) == 3


def test_actor_gives_up_after_the_bound_with_one_line_and_nothing_torn(emulator, tmp_path):
    from gagpo.actors.actor import run_actor

    url = f"s3://outage/{tmp_path.name}"
    stopped_at = []

    def outage_after_first_group(summary) -> None:
        if summary.groups == 1:
            emulator.stop()
            stopped_at.append(time.monotonic())

    with pytest.raises(StoreUnavailableError) as info:
        run_actor(actor_config(url, 2.0), progress=outage_after_first_group)
    waited = time.monotonic() - stopped_at[0]
    message = str(info.value)
    assert (
        "\n" not in message and "did not answer" in message and "to wait longer than 2 s" in message
    )
    assert 2.0 <= waited < 60
    emulator.start()  # the store comes back after the actor gave up
    store = Store(url)
    assert store.list_shards() == []  # the uncommitted groups are gone, nothing half-written
    assert store.glob(store.path("shards", "**")) == []


def test_retrying_backs_off_exponentially_with_one_line_per_retry(caplog):
    failures = [ConnectionResetError("reset"), TimeoutError("slow"), OSError("SlowDown")]
    delays: list[float] = []

    def flaky() -> str:
        if failures:
            raise failures.pop(0)
        return "done"

    with caplog.at_level(logging.WARNING, logger="gagpo.store"):
        assert retrying(flaky, "reading x", bound_s=60, sleep=delays.append) == "done"
    assert len(delays) == 3  # 0.5 s, 1 s, 2 s, each jittered down by up to half
    assert all(base / 2 <= d <= base for d, base in zip(delays, [0.5, 1.0, 2.0], strict=True))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "retry 3 in" in lines[2] and "OSError: SlowDown" in lines[2]


def test_retrying_stops_at_once_on_errors_that_are_not_outages():
    calls = []

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError):
        retrying(missing, "reading x", bound_s=60, sleep=lambda s: None)
    assert calls == [1]
    assert is_transient(ConnectionRefusedError()) and not is_transient(ValueError("bad"))


# --- every command: one line, exit code 2 --------------------------------------------
def _dead_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there after


COMMANDS = {
    "actors": ["-m", "gagpo.actors.cli", "--policy", "tiny", "--groups", "1", "--quiet"],
    "learner": ["-m", "gagpo.learner.cli", "--policy", "tiny", "--updates", "1", "--quiet"],
    "advantages": ["-m", "gagpo.pipeline.cli"],
    "sql": ["-m", "gagpo.inspection.cli", "sql", "SELECT count(*) FROM steps"],
    "report": ["-m", "gagpo.inspection.cli", "report"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_unreachable_store_is_one_line_and_exit_2(command, tmp_path):
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": _dead_endpoint(),
        "AWS_MAX_ATTEMPTS": "1",
        "GAGPO_STORE_RETRY_S": "1",
    }
    args = [*COMMANDS[command], "--store", "s3://nowhere/store"]
    if command == "report":
        args += ["--out", str(tmp_path / "report")]
    if command == "actors":
        args += ["--store-retry-seconds", "1"]
    result = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "did not answer" in lines[0]

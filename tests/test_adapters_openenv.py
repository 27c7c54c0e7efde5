"""The OpenEnv HTTP adapter (`--env openenv+http://HOST:PORT`) against a loopback server
the test starts (tests/helpers/openenv_loopback.py), including a server that dies mid-rollout:
that group is lost alone, with one line, and the actor carries on."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from gagpo.envs import make_env
from gagpo.envs.openenv_env import EnvironmentLost
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.validate import validate_steps
from tests.helpers.actors import actors_command

ROOT = Path(__file__).resolve().parents[1]


class Server:
    """One loopback server process; `stop()` ends it by its own PID."""

    def __init__(self, port: int = 0, die_after: int | None = None) -> None:
        args = [sys.executable, "-m", "tests.helpers.openenv_loopback", "--port", str(port)]
        if die_after is not None:
            args += ["--die-after", str(die_after)]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def servers():
    started: list[Server] = []

    def start(**kwargs) -> Server:
        started.append(Server(**kwargs))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def test_reset_step_state_over_http(servers):
    server = servers()
    env = make_env(f"openenv+{server.url}", 10)
    first = env.reset(4)  # target = 2 + 4 % 3 = 3
    assert first.state_key == '{"position":0,"target":3}'  # /state without its bookkeeping
    assert first.admissible == ("step", "stay") and "Walk to the goal" in first.observation
    stay = env.step("stay")
    assert stay.action_valid and stay.next_state_key == first.state_key
    unknown = env.step("dance")  # the observation says action_valid: false
    assert not unknown.action_valid and not unknown.done
    refused = env.step("   ")  # HTTP 422: does not fit the action schema; nothing happened
    assert not refused.action_valid and refused.reward == 0.0
    assert refused.next_state_key == first.state_key and "refused" in refused.observation
    steps = [env.step("step") for _ in range(3)]
    assert [t.won for t in steps] == [False, False, True] and steps[-1].done
    assert steps[-1].reward == 1.0 and steps[-1].next_state_key is None
    # reset per rollout on the same instance: seed 4, then 5, then 4 again
    b = env.reset(5)
    env.step("step")
    again = env.reset(4)
    assert (again.observation, again.state_key) == (first.observation, first.state_key)
    assert b.state_key != first.state_key
    env.close()


def test_a_shared_server_and_too_many_slots_are_one_line(servers):
    server = servers()
    name = f"openenv+{server.url}"
    one = make_env(name, 10)
    with pytest.raises(GagpoError, match="all 1 of its servers are held by other rollout slots"):
        make_env(name, 10)
    one.reset(0)
    one.close()  # given back: the next slot built may take it
    other = make_env(name, 10)
    other.reset(1)
    # an adapter that did not hold the server (built before another reset it) finds out
    one._episode = "someone-else"  # as if a second client had reset the server since
    with pytest.raises(GagpoError, match="was reset by another rollout") as exc:
        one._state()
    assert "\n" not in str(exc.value)


def test_a_server_held_in_another_process_is_not_taken(servers):
    """The hold spans processes (worker processes of --env-executor process, other actors
    on the machine): a lock file per server, dropped when the holder ends."""
    server = servers()
    name = f"openenv+{server.url}"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from gagpo.envs import make_env; "
            f"env = make_env({name!r}, 5); print('held', flush=True); sys.stdin.read()",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(GagpoError, match="held by other rollout slots"):
            make_env(name, 5)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    make_env(name, 5).reset(0)  # the holder ended: the server is free again


def test_a_dying_server_is_one_line(servers):
    server = servers(die_after=2)
    env = make_env(f"openenv+{server.url}", 10)
    env.reset(0)
    env.step("stay")
    with pytest.raises(EnvironmentLost) as exc:
        env.step("stay")
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(f"OpenEnv server {server.url} stopped answering /step at turn 2 (")
    assert isinstance(exc.value, GagpoError)
    env.close()
    with pytest.raises(EnvironmentLost, match="stopped answering /reset at reset"):
        make_env(f"openenv+{server.url}", 10, reset_wait_s=0.3).reset(0)


def test_malformed_urls_are_refused():
    for url in ("openenv+ftp://x:1", "openenv+http://"):
        with pytest.raises(GagpoError, match="accepted: openenv"):
            make_env(url, 3)


@pytest.mark.slow
def test_server_dying_mid_rollout_loses_that_group_alone(servers, store_dir: Path):
    """gagpo-actors with G = 2 on two servers (one per slot); the first dies on its 6th
    step request, in the second group, and its supervisor (here: a thread) restarts it.
    The second group is lost with one line; the first and third are committed."""
    steady = servers()
    dying = servers(die_after=6)
    port, restarted = dying.port, []

    def supervise() -> None:
        dying.proc.wait()
        restarted.append(servers(port=port))

    watcher = threading.Thread(target=supervise, daemon=True)
    watcher.start()
    url = f"openenv+http://127.0.0.1:{dying.port},127.0.0.1:{steady.port}"
    result = subprocess.run(
        actors_command(
            store_dir, env=url, groups=3, group_size=2, max_turns=4, seed=0, env_executor="inline"
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    watcher.join(timeout=30)
    assert result.returncode == 0, result.stderr[-3000:]
    assert restarted, "the dying server never died"
    lost = [line for line in result.stderr.splitlines() if " lost: " in line]
    assert len(lost) == 1, result.stderr
    assert f"OpenEnv server http://127.0.0.1:{port} stopped answering /step" in lost[0]
    assert "Traceback" not in result.stderr
    shards = sorted(store_dir.glob("shards/run=*/*.parquet"))
    for path in shards:
        table = pq.read_table(path)
        validate_steps(table, table.schema.metadata)
    steps = pl.read_parquet(shards)
    assert steps[C.GROUP_ID].n_unique() == 2  # 3 groups played, the second lost
    assert sorted(steps[C.TASK_ID].unique()) == [f"{url}-0", f"{url}-2"]
    assert steps[C.TRAJ_ID].n_unique() == 4
    assert (~steps[C.ACTION_VALID]).sum() > 0  # the tiny policy's words are not commands

"""K groups in flight (actors/rollout.py) and environment slots (actors/slots.py).

The actor loop plays several groups at once; these tests hold it to the bookkeeping of the
one-group-at-a-time loop: the same tasks and seeds, G rollouts a group, valid shards, every
behaviour log-prob that of the version its step records, a failing environment costing
its own group only, and no torn shard when interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from gagpo.actors.actor import run_actor
from gagpo.actors.config import ActorConfig
from gagpo.actors.slots import Slots
from gagpo.envs.sokoban import Sokoban
from gagpo.schemas import columns as C
from gagpo.schemas.validate import ValidationError, validate_steps
from gagpo.storage.store import Store
from tests.helpers.actors import actors_command
from tests.helpers.envs import Staggered
from tests.helpers.procs import group_members
from tests.helpers.steps import steps_of
from tests.helpers.versions import fresh_logprobs, perturbed_copy

G = 4


def actor_config(store: Path, **overrides) -> ActorConfig:
    base = dict(
        store=str(store),
        env="sokoban",
        policy="tiny",
        groups=6,
        group_size=G,
        max_turns=4,
        seed=11,
        history_window=1,
        run_id="r",
        sampling={"max_new_tokens": 3},
    )
    return ActorConfig(**(base | overrides))


def by_task(steps: pl.DataFrame) -> pl.DataFrame:
    """Rollouts per task and what their steps hold, keyed by task and rollout index j."""
    return steps.with_columns(pl.col(C.TRAJ_ID).str.split("-").list.last().alias("j")).select(
        C.TASK_ID, "j", C.STEP, C.ACTION_TEXT, C.BEHAVIOR_LOGPROBS, C.POLICY_VERSION
    )


def test_k_groups_in_flight_play_the_tasks_of_one_at_a_time(tmp_path: Path):
    one = run_actor(actor_config(tmp_path / "k1", groups_in_flight=1))
    four = run_actor(actor_config(tmp_path / "k4", groups_in_flight=4))
    assert (one.groups, four.groups) == (6, 6) and four.groups_in_flight == 4
    a, b = steps_of(tmp_path / "k1"), steps_of(tmp_path / "k4")
    for steps in (a, b):
        per_group = steps.group_by(C.GROUP_ID).agg(
            pl.col(C.TRAJ_ID).n_unique().alias("n"), pl.col(C.TASK_ID).n_unique().alias("tasks")
        )
        assert per_group["n"].to_list() == [G] * 6 and set(per_group["tasks"]) == {1}
    # The same tasks (task seed = seed + k), each once.
    assert (
        sorted(set(a[C.TASK_ID]))
        == sorted(set(b[C.TASK_ID]))
        == [f"sokoban-{11 + k}" for k in range(6)]
    )
    # Groups are committed as they end, so shards need not follow task order; every group
    # is a shard of its own here (groups_per_shard = 1).
    assert len(Store(str(tmp_path / "k4")).list_shards()) == 6


def test_a_run_is_reproducible_for_a_given_k(tmp_path: Path):
    for name in ("a", "b"):
        run_actor(actor_config(tmp_path / name, groups_in_flight=3))
    a, b = by_task(steps_of(tmp_path / "a")), by_task(steps_of(tmp_path / "b"))
    assert a.sort(C.TASK_ID, "j", C.STEP).equals(b.sort(C.TASK_ID, "j", C.STEP))


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_environment_executors_play_identical_rollouts(tmp_path: Path, executor: str):
    """Where environments step does not change what is played: the lockstep schedule is
    fixed, so the thread pool, worker processes and the calling thread agree exactly."""
    run_actor(actor_config(tmp_path / "thread", groups_in_flight=2, groups=3))
    run_actor(
        actor_config(
            tmp_path / executor, groups_in_flight=2, groups=3, env_executor=executor, env_workers=2
        )
    )
    a, b = by_task(steps_of(tmp_path / "thread")), by_task(steps_of(tmp_path / executor))
    assert a.sort(C.TASK_ID, "j", C.STEP).equals(b.sort(C.TASK_ID, "j", C.STEP))


def test_behaviour_logprobs_are_those_of_the_version_each_step_records(tmp_path: Path, monkeypatch):
    """LATEST moves to v1 while groups are in flight: the actor loads it between turns, so a
    group spans v0 and v1, and every step's log-probs are those of the version it records."""
    import gagpo.actors.actor as actor

    monkeypatch.setattr(actor, "make_env", lambda name, max_turns, **o: Staggered(max_turns=6))
    store_dir = tmp_path / "store"
    first = run_actor(actor_config(store_dir, groups=1))  # publishes v0
    store = Store(str(store_dir))
    v0 = Path(store.policies.dir(0))
    perturbed_copy(v0, Path(store.policies.dir(1)))
    store.policies.set_latest(1)
    for ref in store.list_shards():  # keep only the run below
        os.remove(ref.path)
    summary = run_actor(
        actor_config(store_dir, groups=5, groups_in_flight=3, max_turns=6, run_id="s")
    )
    assert first.versions == {0} and summary.versions == {0, 1}
    steps = steps_of(store_dir)
    spans = steps.group_by(C.GROUP_ID).agg(pl.col(C.POLICY_VERSION).n_unique().alias("n"))
    assert spans["n"].max() == 2, "some group in flight should have spanned v0 and v1"
    checked = Counter()
    for row in steps.iter_rows(named=True):
        version = row[C.POLICY_VERSION]
        fresh = fresh_logprobs(
            Path(store.policies.dir(version)), row[C.PROMPT_IDS], row[C.ACTION_IDS]
        )
        # float32 on a CPU; batching changes float noise only
        assert fresh == pytest.approx(row[C.BEHAVIOR_LOGPROBS], abs=2e-4)
        checked[version] += 1
    assert checked[0] > 0 and checked[1] > 0


class _Flaky(Sokoban):
    """A sokoban that raises on its third step of task seed 13."""

    def reset(self, task_seed: int):
        self._seed, self._steps = task_seed, 0
        return super().reset(task_seed)

    def step(self, reply: str):
        self._steps += 1
        if self._seed == 13 and self._steps == 3:
            raise ConnectionError("engine went away")
        return super().step(reply)


def test_a_group_whose_environment_raises_is_lost_alone(tmp_path: Path, monkeypatch):
    import gagpo.actors.actor as actor

    monkeypatch.setattr(actor, "make_env", lambda name, max_turns, **o: _Flaky(max_turns=max_turns))
    warnings: list[str] = []
    summary = run_actor(
        actor_config(tmp_path, groups=6, groups_in_flight=3, max_turns=5), warn=warnings.append
    )
    assert summary.groups_lost == 1 and summary.groups == 5
    assert (
        len(warnings) == 1 and "task seed 13" in warnings[0] and "engine went away" in warnings[0]
    )
    tasks = set(steps_of(tmp_path)[C.TASK_ID])
    assert "sokoban-13" not in tasks and len(tasks) == 5


def test_environments_are_built_once_per_slot(tmp_path: Path, monkeypatch):
    import gagpo.actors.actor as actor

    built = []

    def counted(name, max_turns, **options):
        built.append(1)
        return Sokoban(max_turns=max_turns)

    monkeypatch.setattr(actor, "make_env", counted)
    run_actor(actor_config(tmp_path, groups=8, groups_in_flight=2))
    assert len(built) == 1 + 2 * G  # one probe (stop strings), then one per slot


def test_slots_report_errors_through_their_futures_and_rebuild():
    made = []

    def make():
        made.append(1)
        return _Flaky(max_turns=5)

    with Slots(make, 2, executor="thread") as slots:
        slots.reset(0, 13).result()
        for _ in range(2):
            slots.step(0, "up").result()
        with pytest.raises(ConnectionError):
            slots.step(0, "up").result()
        slots.discard(0)
        assert slots.reset(0, 13).result().reset.state_key  # a fresh environment
    assert len(made) == 2


def test_a_rollout_whose_version_falls_is_rejected():
    rows = {name: [] for name in C.STEPS_COLUMNS}
    for step, version in enumerate([0, 2, 1]):
        row = {
            C.RUN_ID: "r",
            C.SHARD_ID: "s",
            C.GROUP_ID: "g",
            C.TRAJ_ID: "g-0",
            C.STEP: step,
            C.ENV: "e",
            C.TASK_ID: "t",
            C.STATE_KEY: "k",
            C.NEXT_STATE_KEY: "k",
            C.OBSERVATION: "o",
            C.PROMPT_IDS: [1],
            C.ACTION_TEXT: "a",
            C.ACTION_IDS: [1],
            C.BEHAVIOR_LOGPROBS: [-0.5],
            C.POLICY_VERSION: version,
            C.REWARD: 0.0,
            C.DONE: step == 2,
            C.TRUNCATED: False,
            C.ACTION_VALID: True,
            C.WON: False,
            C.CREATED_AT: datetime.now(UTC),
        }
        for k, v in row.items():
            rows[k].append(v)
    table = pa.Table.from_pydict(rows, schema=C.STEPS_SCHEMA)
    meta = {C.META_SCHEMA_VERSION: C.STEPS_SCHEMA_VERSION.encode(), C.META_GROUP_SIZE: b"1"}
    with pytest.raises(ValidationError, match="goes back from policy version 2 to 1"):
        validate_steps(table, meta)
    rising = table.set_column(
        table.schema.get_field_index(C.POLICY_VERSION),
        C.POLICY_VERSION,
        pa.array([0, 1, 1], pa.int64()),
    )
    validate_steps(rising, meta)  # a rollout that spans versions upwards is whole and valid


@pytest.mark.slow
def test_sigint_with_groups_in_flight_leaves_no_torn_shard(tmp_path: Path):
    store_dir = tmp_path / "store"
    cmd = actors_command(
        store_dir,
        env="household",
        follow=True,
        no_throttle=True,
        group_size=3,
        max_turns=6,
        groups_in_flight=4,
    )
    store = Store(str(store_dir))
    for seed, shards in ((3, 1), (5, 3)):
        before = len(store.list_shards()) if store_dir.exists() else 0
        proc = subprocess.Popen(
            [*cmd, "--seed", str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 120
        # Signal once it has committed a few groups: others are in flight then.
        while time.monotonic() < deadline and proc.poll() is None:
            if store_dir.exists() and len(store.list_shards()) >= before + shards:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # finish the groups in flight, commit, exit
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        assert "4 group(s) in flight" in out
        assert len(store.list_shards()) > before + shards  # those in flight were committed too
    refs = store.list_shards()
    assert refs, "the actors committed nothing"
    for ref in refs:
        store.read_shard(ref)  # raises if torn or incomplete
    assert store.quarantined() == []
    leftovers = [p for p in store_dir.rglob(".*") if p.is_file() and "tmp" in p.name]
    assert leftovers == []


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["process", "thread", "inline"])
def test_ctrl_c_from_a_terminal_ends_the_actor_as_sigint_to_its_pid_does(tmp_path, executor):
    """A terminal's Ctrl-C is SIGINT to the whole process group, the executor's worker
    processes included: they ignore it, the actor finishes its groups in flight, commits,
    ends them and exits 0; no traceback, nothing torn, nothing of the group left alive."""
    store_dir = tmp_path / "store"
    cmd = actors_command(
        store_dir,
        env="sokoban",
        follow=True,
        no_throttle=True,
        group_size=3,
        max_turns=6,
        groups_in_flight=2,
        env_executor=executor,
        env_workers=2,
        seed=7,
    )
    store = Store(str(store_dir))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )  # (its own group, as a shell's job)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if store_dir.exists() and len(store.list_shards()) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        if executor == "process":
            assert len(group_members(proc.pid)) >= 3  # the actor and its 2 workers
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "error" not in err.lower(), err[-2000:]
    for ref in store.list_shards():
        store.read_shard(ref)  # raises if torn or incomplete
    assert store.quarantined() == []
    deadline = time.monotonic() + 10
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(proc.pid) == []


class _Counting(Sokoban):
    """Counts how many of its kind run `reset` at once (a slow engine call)."""

    lock, running, most = __import__("threading").Lock(), 0, 0

    def reset(self, task_seed: int):
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
        time.sleep(0.05)
        with cls.lock:
            cls.running -= 1
        return super().reset(task_seed)


class _Unsafe(_Counting):
    thread_safe = False  # like TextWorld's engine: process-global state
    lock, running, most = __import__("threading").Lock(), 0, 0


def test_engines_that_are_not_thread_safe_step_one_at_a_time():
    for cls, expect_overlap in ((_Counting, True), (_Unsafe, False)):
        with Slots(lambda cls=cls: cls(max_turns=3), 4, executor="thread") as slots:
            for f in [slots.reset(slot, 1) for slot in range(4)]:
                f.result()
        assert (cls.most > 1) == expect_overlap, (cls.__name__, cls.most)

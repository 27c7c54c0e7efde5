"""The actor loop: load the newest policy, play a group, commit whole groups as shards.

The store is the only channel to the learner: as groups end the actor reads
`policy/LATEST`, downloads a newer version in the background while it keeps generating
(actors/prefetch.py), and loads it once its files are local (version 0 is the configured
base model); each load's fetch seconds and engine pause go to the summary (`loads`). While following a learner it also reads the
learner's backlog and waits instead of generating groups that would go stale (throttle.py).

`run_actor` sets up and runs `_Loop`: admission (`admit`, `wait_for_room`), outcome
collection (`collect`) and `commit`. What demonstrations (`--expert`) do differently is
chosen once, up front, as a `_Player`.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import pyarrow as pa

from gagpo.actors.config import ActorConfig
from gagpo.actors.demos import DEMO_METADATA, Expert
from gagpo.actors.policies.presets import load_policy, load_version
from gagpo.actors.prefetch import Fetched, Prefetcher
from gagpo.actors.rollout import GroupLost, GroupResult, GroupTask, Rollouts
from gagpo.actors.slots import Slots
from gagpo.actors.throttle import Throttle
from gagpo.envs import make_env
from gagpo.schemas import columns as C
from gagpo.schemas.cache import policy_cache_dir
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.layout import new_id
from gagpo.schemas.seeds import derive_seed
from gagpo.storage.store import ShardRef, Store


@dataclass(frozen=True)
class VersionLoad:
    """What loading one policy version cost the actor (issue 40): the download's seconds,
    overlapped with generation, and the engine's pause, the drain and the load, during
    which no new reply starts."""

    version: int
    fetch_s: float
    drain_s: float
    load_s: float

    @property
    def pause_s(self) -> float:
        return self.drain_s + self.load_s


@dataclass
class ActorSummary:
    """What an actor run produced; printed at the end and returned to callers."""

    run_id: str
    groups: int = 0
    rollouts: int = 0
    steps: int = 0
    tokens: int = 0  # reply tokens sampled
    successes: int = 0
    shards: list[ShardRef] = field(default_factory=list)
    versions: set[int] = field(default_factory=set)
    seconds_total: float = 0.0
    seconds_generate: float = 0.0
    seconds_env: float = 0.0
    seconds_write: float = 0.0
    seconds_throttled: float = 0.0  # waiting for the learner's backlog to shrink (throttle.py)
    groups_lost: int = 0  # dropped because their environment raised (actors/rollout.py)
    groups_in_flight: int = 1  # K
    # Steps after a rollout's first whose prompt does not extend the previous step's prompt
    # and action (schemas/extends.py): drift (an agent that edited its history, a template
    # that rendered a turn afresh) and window slides (a history window that dropped a turn).
    prompt_drift: int = 0
    window_slides: int = 0
    loads: list[VersionLoad] = field(default_factory=list)  # per version loaded, in order

    @property
    def success_rate(self) -> float:
        return self.successes / self.rollouts if self.rollouts else 0.0

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds_total if self.seconds_total else 0.0

    def add(self, result: GroupResult) -> None:
        self.groups += 1
        self.rollouts += result.rollouts
        self.steps += result.steps
        self.tokens += sum(len(ids) for ids in result.columns[C.ACTION_IDS])
        self.successes += result.successes
        self.versions |= result.versions
        self.prompt_drift += result.drift
        self.window_slides += result.slides


def sampling_seed(seed: int, run_id: str, group_index: int) -> int:
    """Distinct sampling seeds per run and group, reproducible from them."""
    return derive_seed(seed, run_id, group_index, bits=32)


class _StopFlag:
    """Set by SIGINT/SIGTERM: the actor finishes its group, commits, and exits."""

    def __init__(self) -> None:
        self.stop = False

    def __call__(self, signum, frame) -> None:
        if self.stop:  # a second signal aborts at once; the group in flight is not written
            raise KeyboardInterrupt
        self.stop = True


# K with a continuous-batching engine (vLLM) when groups_in_flight is unset: K·G = 128
# sequences at G = 8 keep its batches full (benchmarks/bench_vllm.py, docs/gpu.md).
CONTINUOUS_GROUPS_IN_FLIGHT = 16


def run_actor(config: ActorConfig, *, progress=None, warn=None, policy=None) -> ActorSummary:
    """Roll out `config.groups` groups (or until stopped with `follow`) into the store, K
    groups in flight (actors/rollout.py); `warn` gets one line per lost group. `policy`: an
    engine already loaded with the base policy (benchmarks share one), else loaded here."""
    warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
    store = Store(config.store, retry_s=config.store_retry_s)
    store.ensure_writable()
    env_factory = partial(make_env, config.env, config.max_turns, **config.env_options)
    # An unknown environment -> GagpoError before any model is loaded; its stop strings
    # (default: the end of the line) end a reply on engines that take them (vLLM).
    stop_strings = getattr(env_factory(), "stop_strings", None)
    run_id = config.run_id or new_id()
    policy = _base_policy(config, policy, stop_strings)
    # Version 0 lives in the store too: learners start from exactly these weights.
    store.policies.publish_base(str(policy.model_dir))
    player = _player(config, policy, run_id)
    in_flight = config.groups_in_flight or (CONTINUOUS_GROUPS_IN_FLIGHT if player.continuous else 1)
    lanes = in_flight * config.group_size
    slots = Slots(env_factory, lanes, executor=config.env_executor, workers=config.env_workers)
    runner = Rollouts(
        slots,
        policy,
        group_size=config.group_size,
        capacity=in_flight,
        history_window=config.history_window,
        run_id=run_id,
        continuous=player.continuous,
    )
    loop = _Loop(
        config,
        store,
        runner,
        player,
        ActorSummary(run_id, groups_in_flight=in_flight),
        _Admission(Throttle(store) if player.throttled else None),
        Prefetcher(store, str(policy_cache_dir()), warn),
        warn,
    )
    stop = _StopFlag()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        loop.run(stop, progress)
    finally:
        runner.close()
        slots.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return loop.finish()


def _base_policy(config: ActorConfig, policy, stop_strings):
    """The engine serving version 0: `policy` when the caller loaded one, else loaded."""
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    if policy is None:
        policy = load_policy(
            config.policy,
            version=0,
            sampling=config.sampling,
            device=config.device,
            backend=config.backend,
            stop=stop_strings,
            vllm=config.vllm,
            seed=config.seed,
        )
    if stop_strings == ():  # replies that span lines (agents): the HF backend stops at EOS only
        policy.stop_at_newline = False
    return policy


@dataclass(frozen=True)
class _Player:
    """Who plays the groups, chosen once from `config.expert`: the policy, sampling RL
    rollouts, or the environment's expert writing demonstrations (actors/demos.py) that
    the policy only tokenizes. All the loop does differently for the two is here."""

    continuous: bool  # the engine's continuous batching (vLLM): for the policy's own replies
    throttled: bool  # backpressure: RL groups go stale in a backlog, demonstrations do not
    follows_versions: bool  # loads newer versions: a demonstration needs the base tokenizer
    shard_metadata: dict | None  # marks demonstration shards (`gagpo.source`)
    demonstrator: Callable[[], Expert | None]  # one per group: plans are held per group


def _player(config: ActorConfig, policy, run_id: str) -> _Player:
    if config.expert:
        noise_rng = random.Random(sampling_seed(config.seed, run_id, -1))
        return _Player(
            continuous=False,
            throttled=False,
            follows_versions=False,
            shard_metadata=DEMO_METADATA,
            demonstrator=lambda: Expert(policy, config.expert_noise, noise_rng),
        )
    return _Player(
        continuous=hasattr(policy, "submit"),
        # Backpressure only while following a learner: a fixed --groups job is produced as asked.
        throttled=config.follow and config.throttle,
        follows_versions=True,
        shard_metadata=None,
        demonstrator=lambda: None,
    )


@dataclass
class _Loop:
    """The actor loop's state: groups are admitted while there is room, their outcomes
    collected as they end, and whole groups committed `groups_per_shard` at a time."""

    config: ActorConfig
    store: Store
    runner: Rollouts
    player: _Player
    summary: ActorSummary
    admission: _Admission
    prefetch: Prefetcher
    warn: Callable[[str], None]
    pending: list[dict[str, list]] = field(default_factory=list)  # ended, not yet committed
    k: int = 0  # groups started
    lost_in_a_row: int = 0
    start: float = field(default_factory=time.perf_counter)

    def run(self, stop: _StopFlag, progress) -> None:
        while True:
            throttled = self.admit(stop)
            if self.runner.in_flight == 0:
                if not (self.wanted(stop) and throttled):
                    break  # all asked for is done, or stopped
                self.wait_for_room()
                continue
            outcomes = self.runner.advance()
            self.collect(outcomes)
            self.clock()
            if outcomes:
                self.admission.refresh()  # a group ended: the learner's room may have changed
                if progress is not None:
                    progress(self.summary)
                self.switch_to_newest()
        self.commit()

    def wanted(self, stop: _StopFlag) -> bool:
        return not stop.stop and (self.config.follow or self.k < self.config.groups)

    def admit(self, stop: _StopFlag) -> bool:
        """Start the groups there is room for; True when the learner's backlog left none."""
        if not (self.wanted(stop) and self.runner.free):
            return False
        room = self.admission.room(self.runner, held=len(self.pending))
        seed = self.config.seed
        for _ in range(room):
            task = GroupTask(
                self.k,
                task_seed=seed + self.k,
                group_id=new_id(),
                sampling_seed=sampling_seed(seed, self.summary.run_id, self.k),
                demonstrator=self.player.demonstrator(),
            )
            self.runner.start(task)
            self.k += 1
            if not self.wanted(stop):
                break
        return room <= 0

    def wait_for_room(self) -> None:
        """Nothing in flight and no room: commit what is held (the learner cannot see it
        here), then wait until the backlog holds what the learner can use."""
        self.commit()
        throttle = self.admission.throttle
        throttle.pause()
        self.summary.seconds_throttled = throttle.seconds_waited
        self.admission.refresh()
        self.switch_to_newest()

    def collect(self, outcomes: list) -> None:
        """Ended groups join `pending` (committed when a shard's worth is held); a lost one
        is named in one line, and too many lost in a row end the run."""
        for outcome in outcomes:
            if isinstance(outcome, GroupLost):
                self._lost(outcome)
                continue
            self.lost_in_a_row = 0
            self.summary.add(outcome)
            self.pending.append(outcome.columns)
            if len(self.pending) >= self.config.groups_per_shard:
                self.commit()

    def _lost(self, outcome: GroupLost) -> None:
        self.summary.groups_lost += 1
        self.lost_in_a_row += 1
        task = outcome.task
        self.warn(f"group {task.group_id} (task seed {task.task_seed}) lost: {outcome.reason}")
        if self.lost_in_a_row >= max(3, self.summary.groups_in_flight):
            raise GagpoError(
                f"{self.lost_in_a_row} groups lost in a row; the last: {outcome.reason}"
            )

    def commit(self) -> None:
        """The pending groups, as one shard."""
        if self.pending:
            ref = _commit(self.store, self.pending, self.config, self.player, self.summary)
            self.summary.shards.append(ref)
            self.pending = []

    def switch_to_newest(self) -> None:
        if self.player.follows_versions:
            _switch_to_newest(self.store, self.runner, self.prefetch, self.config, self.summary)

    def clock(self) -> None:
        self.summary.seconds_total = time.perf_counter() - self.start
        self.summary.seconds_generate = self.runner.seconds_generate
        self.summary.seconds_env = self.runner.seconds_env

    def finish(self) -> ActorSummary:
        self.clock()
        if self.summary.groups_lost and not self.summary.groups:
            raise GagpoError(
                f"all {self.summary.groups_lost} group(s) were lost to environment errors "
                "(each named above); nothing was committed"
            )
        return self.summary


class _Admission:
    """How many groups may start now: the free lanes, and with backpressure the room the
    learner's backlog leaves (actors/throttle.py). While there is none the backlog is read
    again only after a poll interval, or once `refresh` says a group ended."""

    def __init__(self, throttle: Throttle | None) -> None:
        self.throttle, self._recheck_at = throttle, 0.0

    def room(self, runner: Rollouts, held: int) -> int:
        if self.throttle is None:
            return runner.free
        if time.monotonic() < self._recheck_at:
            return 0
        # Backpressure counts the groups in flight as held: they will be committed.
        room = self.throttle.room(runner.policy.version, held=held + runner.in_flight)
        if room <= 0:
            self._recheck_at = time.monotonic() + self.throttle.poll_s
        return max(0, min(room, runner.free))

    def refresh(self) -> None:
        self._recheck_at = 0.0


def _switch_to_newest(
    store: Store, runner: Rollouts, prefetch: Prefetcher, config: ActorConfig, summary
) -> None:
    """Load the newest version whose files are local, between turns: replies already in
    the engine are finished by the version that started them (their groups go on
    meanwhile). The download ran in the background (actors/prefetch.py), so the engine's
    pause, recorded per version, is the drain and the load alone."""
    fetched = prefetch.ready(runner.policy.version)
    if fetched is None:
        return
    t0 = time.perf_counter()
    runner.drain()
    t1 = time.perf_counter()
    fresh = _load(store, runner.policy, fetched, config)
    if fresh is None:
        return  # pruned before it was loaded: the next poll reads LATEST again
    runner.policy = fresh
    load = VersionLoad(fetched.version, fetched.seconds, t1 - t0, time.perf_counter() - t1)
    summary.loads.append(load)
    prefetch.record(load, summary.run_id)  # the store's policy/loads/: gagpo sql policy_loads


def _load(store: Store, policy, fetched: Fetched, config: ActorConfig):
    """`policy` serving the fetched version; None when that version was pruned meanwhile
    (a local store's folder is the store's own, which the learner prunes)."""
    try:
        # vLLM: the running engine loads the new weights (or adapter) in place
        fresh = load_version(
            policy, fetched.folder, fetched.version, sampling=config.sampling, device=config.device
        )
    except (FileNotFoundError, GagpoError):
        if store.policies.has(fetched.version):
            raise  # the version is there: a real problem, not a race with pruning
        return None
    fresh.stop_at_newline = getattr(policy, "stop_at_newline", True)
    return fresh


def _commit(
    store: Store,
    groups: list[dict[str, list]],
    config: ActorConfig,
    player: _Player,
    summary: ActorSummary,
) -> ShardRef:
    t0 = time.perf_counter()
    merged = {name: [v for g in groups for v in g[name]] for name in C.STEPS_COLUMNS}
    merged[C.SHARD_ID] = [new_id()] * len(merged[C.STEP])  # groups finish in any order
    ref = store.write_shard(
        pa.Table.from_pydict(merged, schema=C.STEPS_SCHEMA),
        group_size=config.group_size,
        extra_metadata=player.shard_metadata,
    )
    summary.seconds_write += time.perf_counter() - t0
    return ref

"""The actor loop: load the newest policy, play a group, commit whole groups as shards.

The store is the only channel to the learner: as groups end the actor reads
`policy/LATEST`, downloads a newer version in the background while it keeps generating
(actors/prefetch.py), and loads it once its files are local (version 0 is the configured
base model); each load's fetch seconds and engine pause go to the summary (`loads`). While following a learner it also reads the
learner's backlog and waits instead of generating groups that would go stale (throttle.py).
"""

from __future__ import annotations

import random
import signal
import sys
import time
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
from gagpo.schemas.seeds import derive_seed
from gagpo.storage.store import ShardRef, Store, new_id


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
    # and action (an agent that edited its history, a window that dropped a turn).
    prompt_breaks: int = 0
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
        self.prompt_breaks += result.breaks


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
    summary = ActorSummary(run_id=run_id)

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
    # Version 0 lives in the store too: learners start from exactly these weights.
    store.policies.publish_base(str(policy.model_dir))
    continuous = hasattr(policy, "submit") and not config.expert
    in_flight = config.groups_in_flight or (CONTINUOUS_GROUPS_IN_FLIGHT if continuous else 1)
    summary.groups_in_flight = in_flight
    slots = Slots(
        env_factory,
        in_flight * config.group_size,
        executor=config.env_executor,
        workers=config.env_workers,
    )
    runner = Rollouts(
        slots,
        policy,
        group_size=config.group_size,
        capacity=in_flight,
        history_window=config.history_window,
        run_id=run_id,
        continuous=continuous,
    )
    stop = _StopFlag()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    pending: list[dict[str, list]] = []
    # Backpressure only while following a learner: a fixed --groups job is produced as asked.
    throttle = Throttle(store) if config.follow and config.throttle and not config.expert else None
    noise_rng = random.Random(sampling_seed(config.seed, run_id, -1))
    admission = _Admission(throttle)
    prefetch = Prefetcher(store, str(policy_cache_dir()), warn)
    start, k, lost_in_a_row = time.perf_counter(), 0, 0
    try:
        while True:
            wanted = not stop.stop and (config.follow or k < config.groups)
            throttled = False
            if wanted and runner.free:
                room = admission.room(runner, held=len(pending))
                throttled = room <= 0
                for _ in range(room):
                    demo = Expert(policy, config.expert_noise, noise_rng) if config.expert else None
                    runner.start(
                        GroupTask(
                            k,
                            config.seed + k,
                            new_id(),
                            sampling_seed(config.seed, run_id, k),
                            demo,
                        )
                    )
                    k += 1
                    if stop.stop or not (config.follow or k < config.groups):
                        break
                wanted = not stop.stop and (config.follow or k < config.groups)
            if runner.in_flight == 0:
                if not (wanted and throttled):
                    break  # all asked for is done, or stopped
                if pending:  # groups held here are invisible to the learner: commit them
                    summary.shards.append(_commit(store, pending, config, summary))
                    pending = []
                throttle.pause()  # type: ignore[union-attr]  # the backlog holds what it can use
                summary.seconds_throttled = throttle.seconds_waited  # type: ignore[union-attr]
                admission.refresh()
                if not config.expert:
                    _switch_to_newest(store, runner, prefetch, config, summary)
                continue
            outcomes = runner.advance()
            for outcome in outcomes:
                if isinstance(outcome, GroupLost):
                    summary.groups_lost += 1
                    lost_in_a_row += 1
                    warn(
                        f"group {outcome.task.group_id} (task seed {outcome.task.task_seed}) "
                        f"lost: {outcome.reason}"
                    )
                    if lost_in_a_row >= max(3, in_flight):
                        raise GagpoError(
                            f"{lost_in_a_row} groups lost in a row; the last: {outcome.reason}"
                        )
                    continue
                lost_in_a_row = 0
                summary.add(outcome)
                pending.append(outcome.columns)
                if len(pending) >= config.groups_per_shard:
                    summary.shards.append(_commit(store, pending, config, summary))
                    pending = []
            summary.seconds_total = time.perf_counter() - start
            summary.seconds_generate, summary.seconds_env = (
                runner.seconds_generate,
                runner.seconds_env,
            )
            if outcomes:
                admission.refresh()  # a group ended: the learner's room may have changed
            if outcomes and progress is not None:
                progress(summary)
            if outcomes and not config.expert:  # demonstrations need the base tokenizer only
                _switch_to_newest(store, runner, prefetch, config, summary)
        if pending:
            summary.shards.append(_commit(store, pending, config, summary))
    finally:
        runner.close()
        slots.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary.seconds_total = time.perf_counter() - start
    summary.seconds_generate, summary.seconds_env = runner.seconds_generate, runner.seconds_env
    if summary.groups_lost and not summary.groups:
        raise GagpoError(
            f"all {summary.groups_lost} group(s) were lost to environment errors "
            "(each named above); nothing was committed"
        )
    return summary


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
    summary.loads.append(
        VersionLoad(fetched.version, fetched.seconds, t1 - t0, time.perf_counter() - t1)
    )


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
    store: Store, groups: list[dict[str, list]], config: ActorConfig, summary: ActorSummary
) -> ShardRef:
    t0 = time.perf_counter()
    merged = {name: [v for g in groups for v in g[name]] for name in C.STEPS_COLUMNS}
    merged[C.SHARD_ID] = [new_id()] * len(merged[C.STEP])  # groups finish in any order
    ref = store.write_shard(
        pa.Table.from_pydict(merged, schema=C.STEPS_SCHEMA),
        group_size=config.group_size,
        extra_metadata=DEMO_METADATA if config.expert else None,
    )
    summary.seconds_write += time.perf_counter() - t0
    return ref

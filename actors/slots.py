"""Environment slots: one environment per rollout slot, built once and reset per rollout.

An actor with K groups in flight plays K·G rollouts at once; each sits in a *slot* whose
environment is built on first use and then reset for every rollout that slot plays
(docs/environments.md, "reset(seed)"). Building once matters for engines that are slow
to start: a TextWorld-Express game starts a JVM, reasoning-gym builds its dataset.

Environment steps run off the main thread, so they overlap generation:

- `thread` (default): a thread pool. Each slot is stepped by one task at a time, so an
  environment needs no locking of its own; pure-Python environments share the GIL, while
  engines that release it (I/O, subprocesses, native code) step in parallel. An engine
  with process-global state says `thread_safe = False` (TextWorld, ALFWorld): its calls
  then run one at a time.
- `process`: worker processes (spawned, never forked from a process holding torch and
  its threads), each owning the environments of its slots; for engines whose steps hold
  the GIL for long (ALFWorld's planner takes 60-110 ms a step).
- `inline`: on the calling thread, nothing overlaps (debugging, profiling).

Every call returns a `Future`. A call that raises resolves its future with the exception,
and the caller decides what is lost (the rollout loop loses that group alone); the slot's
environment is then rebuilt before its next use, since one that raised may be broken.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import count
from typing import Any, Literal

from gagpo.envs.base import Environment, Reset, Transition, capabilities
from gagpo.schemas.signals import sigint_ignored

Executor = Literal["thread", "process", "inline"]


@dataclass(frozen=True)
class Started:
    """What resetting a slot gives back: the first observation and the prompt's framing."""

    reset: Reset
    env_name: str
    instructions: str


def _reset(env: Environment, task_seed: int) -> Started:
    return Started(env.reset(task_seed), env.name, env.instructions)


def _call(env: Environment, method: str, args: tuple) -> Any:
    """An optional method of the environment (expert_plan, replan); None where it has none."""
    fn = getattr(env, method, None)
    return fn(*args) if callable(fn) else None


class Slots:
    """`size` environment slots behind one executor; see the module docstring."""

    def __init__(
        self,
        make_env: Callable[[], Environment],
        size: int,
        *,
        executor: Executor = "thread",
        workers: int = 0,
    ) -> None:
        self.size = size
        self.executor = executor
        workers = workers or min(size, 32 if executor == "thread" else 4)
        self._make_env = make_env
        if executor == "process":
            self._backend: _Backend = _ProcessBackend(make_env, size, workers)
        else:
            self._backend = _LocalBackend(make_env, size, workers if executor == "thread" else 0)

    def reset(self, slot: int, task_seed: int) -> Future[Started]:
        return self._backend.submit(slot, "reset", (task_seed,))

    def step(self, slot: int, reply: str) -> Future[Transition]:
        return self._backend.submit(slot, "step", (reply,))

    def env(self, slot: int) -> Environment:
        """The slot's environment for synchronous use by a demonstrator (its expert_plan,
        replan); in process mode a proxy whose calls run in the owning worker."""
        return self._backend.handle(slot)

    def discard(self, slot: int) -> None:
        """Rebuild the slot's environment before its next use (it raised; may be broken)."""
        self._backend.submit(slot, "discard", ())

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> Slots:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Backend:
    def submit(self, slot: int, op: str, args: tuple) -> Future: ...

    def handle(self, slot: int) -> Environment: ...

    def close(self) -> None: ...


# Engines with process-global state (TextWorld's and ALFWorld's parsers and game loader)
# declare `thread_safe = False`: their calls, and every environment's construction, take
# this lock, so threads step them one at a time (worker processes still run in parallel).
_ENGINE_LOCK = threading.RLock()


def _run(envs: dict[int, Environment], make_env, slot: int, op: str, args: tuple) -> Any:
    """One operation on slot `slot`'s environment, building it first where needed."""
    env = envs.get(slot)
    if env is None and op != "discard":
        with _ENGINE_LOCK:
            env = envs[slot] = make_env()
    if env is not None and not capabilities(env).thread_safe:
        with _ENGINE_LOCK:
            return _apply(envs, make_env, slot, op, args)
    return _apply(envs, make_env, slot, op, args)


def _apply(envs: dict[int, Environment], make_env, slot: int, op: str, args: tuple) -> Any:
    if op == "discard":
        env = envs.pop(slot, None)
        close = getattr(env, "close", None)
        if callable(close):  # a broken environment may fail to close too; it is dropped
            with contextlib.suppress(Exception):
                close()
        return None
    env = envs.get(slot)
    if env is None:
        env = envs[slot] = make_env()
    if op == "reset":
        return _reset(env, *args)
    if op == "step":
        return env.step(*args)
    return _call(env, op, args)


class _LocalBackend(_Backend):
    """Threads (workers > 0) or the calling thread (workers = 0)."""

    def __init__(self, make_env, size: int, workers: int) -> None:
        self._envs: dict[int, Environment] = {}
        self._make_env = make_env
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="env") if workers else None

    def submit(self, slot: int, op: str, args: tuple) -> Future:
        if self._pool is not None:
            return self._pool.submit(_run, self._envs, self._make_env, slot, op, args)
        future: Future = Future()
        try:
            future.set_result(_run(self._envs, self._make_env, slot, op, args))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def handle(self, slot: int) -> Environment:
        env = self._envs.get(slot)
        if env is None:
            with _ENGINE_LOCK:
                env = self._envs[slot] = self._make_env()
        return env

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for slot in list(self._envs):
            _run(self._envs, self._make_env, slot, "discard", ())


def _worker(conn, make_env) -> None:
    """A worker process: run each (id, slot, op, args) it receives, answer (id, ok, value).
    It ignores SIGINT (started so, see schemas/signals.py): a terminal's Ctrl-C reaches the
    whole process group, and the actor, not its workers, decides what stops and when."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    envs: dict[int, Environment] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            for slot in list(envs):
                _run(envs, make_env, slot, "discard", ())
            return
        call_id, slot, op, args = message
        try:
            conn.send((call_id, True, _run(envs, make_env, slot, op, args)))
        except Exception as exc:  # the exception travels back; its class may not pickle
            conn.send((call_id, False, f"{type(exc).__name__}: {exc}"))


class EnvironmentFailed(RuntimeError):
    """An exception raised by an environment in a worker process (its message kept)."""


class _ProcessBackend(_Backend):
    """Worker processes own the environments; slot s lives in worker s % workers."""

    def __init__(self, make_env, size: int, workers: int) -> None:
        context = mp.get_context("spawn")
        self._ids = count()
        self._futures: dict[int, Future] = {}
        self._proxies: dict[int, _RemoteEnv] = {}
        self._lock = threading.Lock()
        self._conns, self._procs, self._send_locks = [], [], []
        for _ in range(workers):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(child, make_env), daemon=True)
            with sigint_ignored():  # workers ignore it for good (_worker)
                proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
            self._send_locks.append(threading.Lock())
            threading.Thread(target=self._read, args=(parent, proc), daemon=True).start()

    def _read(self, conn, proc) -> None:
        while True:
            try:
                call_id, ok, value = conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._futures.pop(call_id, None)
            if future is not None:
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(EnvironmentFailed(value))
        # The worker is gone: what it still owed fails (the groups concerned are lost).
        with self._lock:
            owed = [f for f in self._futures.values() if not f.done()]
        for future in owed:
            if not future.done():
                future.set_exception(
                    EnvironmentFailed(f"environment worker process {proc.pid} ended")
                )

    def submit(self, slot: int, op: str, args: tuple) -> Future:
        future: Future = Future()
        call_id = next(self._ids)
        worker = slot % len(self._conns)
        with self._lock:
            self._futures[call_id] = future
        try:
            with self._send_locks[worker]:
                self._conns[worker].send((call_id, slot, op, args))
        except (OSError, ValueError) as exc:
            with self._lock:
                self._futures.pop(call_id, None)
            future.set_exception(EnvironmentFailed(f"environment worker unreachable: {exc}"))
        return future

    def handle(self, slot: int) -> Environment:
        # One proxy per slot: a demonstrator keys its plans by the environment object.
        return self._proxies.setdefault(slot, _RemoteEnv(self, slot))  # type: ignore[return-value]

    def close(self) -> None:
        for conn, lock in zip(self._conns, self._send_locks, strict=True):
            try:
                with lock:
                    conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


class _RemoteEnv:
    """A slot's environment in a worker process, for synchronous optional-method calls."""

    def __init__(self, backend: _ProcessBackend, slot: int) -> None:
        self._backend, self._slot = backend, slot

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args: self._backend.submit(self._slot, method, args).result()

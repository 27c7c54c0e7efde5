"""Recompute over shards in parallel: an ordered, bounded map over worker processes or Ray
tasks, each turning one shard into its encoded advantages file (`recompute.shard_task`;
docs/design.md §7b).

A shard holds whole groups, so shards are independent and the work is embarrassingly
parallel; only two things stay in shard order, in the calling process: the one-copy-per-
group rule (a group an earlier shard holds quarantines the later one) and the commits.
Workers therefore return the file's bytes (encoded exactly as `Store.write_parquet` would)
and the caller commits them, so the store ends byte for byte as after the serial loop.

At most `workers` shards are in flight (read, computed or waiting to be committed), which
bounds memory by that many shards whatever the store's size. Backends:

- `serial`: in this process, one shard at a time (the default with one worker);
- `processes`: a pool of spawned processes (spawn, not fork: Polars' thread pool does not
  survive a fork), each with its share of the cores for Polars;
- `ray`: Ray tasks, on a running cluster (`address`) or a local instance started here.

Nothing here imports Polars, torch or Ray at module level: a spawned worker sets its
Polars thread count before Polars is first imported.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from gagpo.schemas.errors import GagpoError

BACKENDS = ("serial", "processes", "ray")
MAX_WORKERS = 1024
_STORES: dict[str, Any] = {}  # a worker's Store per URL, opened once


def worker_store(url: str):
    """This worker's Store for `url`, opened once per process."""
    if url not in _STORES:
        from gagpo.schemas.store import Store

        _STORES[url] = Store(url)
    return _STORES[url]


def _init_worker(polars_threads: int) -> None:
    """A spawned worker's first act, before Polars is imported: its share of the cores."""
    os.environ["POLARS_MAX_THREADS"] = str(polars_threads)


def check_workers(workers: int, backend: str) -> None:
    if not 1 <= workers <= MAX_WORKERS:
        raise GagpoError(f"--workers {workers} is out of range; accepted: 1..{MAX_WORKERS}")
    if backend not in BACKENDS:
        raise GagpoError(f"unknown backend {backend!r}; accepted: {', '.join(BACKENDS)}")


def ordered_map(
    fn: Callable[..., Any],
    items: Iterable[Any],
    *,
    args: tuple = (),
    workers: int = 1,
    backend: str = "serial",
    ray_address: str | None = None,
) -> Iterator[Any]:
    """`fn(item, *args)` for each item, yielded in item order, with at most `workers` calls
    in flight (submitted and not yet yielded)."""
    check_workers(workers, backend)
    if backend == "serial":
        for item in items:
            yield fn(item, *args)
        return
    with _executor(backend, workers, ray_address) as submit:
        pending: deque = deque()
        for item in items:
            if len(pending) >= workers:
                yield pending.popleft()()
            pending.append(submit(fn, item, *args))
        while pending:
            yield pending.popleft()()


@contextlib.contextmanager
def _executor(backend: str, workers: int, ray_address: str | None):
    """A `submit(fn, *args) -> get()` for the backend, shut down on exit."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    if backend == "processes":
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker, initargs=(threads,),
        )  # fmt: skip
        try:
            yield lambda fn, *a: pool.submit(fn, *a).result
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return
    ray = import_ray()
    with ray_session(ray_address, num_cpus=workers):
        remote = ray.remote(num_cpus=1)(_call).options(
            runtime_env={"env_vars": {"POLARS_MAX_THREADS": str(threads)}}
        )
        yield lambda fn, *a: _getter(ray, remote.remote(fn, *a))


def _call(fn, *args):
    return fn(*args)


def _getter(ray, ref):
    return lambda: ray.get(ref)


def import_ray():
    """The `ray` module, or one line naming the extra."""
    try:
        import ray
    except ImportError:
        raise GagpoError(
            "--ray needs Ray; accepted: pip install 'gagpo[ray]' (or run without --ray)"
        ) from None
    return ray


@contextlib.contextmanager
def ray_session(address: str | None, *, num_cpus: int, namespace: str | None = None, echo=None):
    """Connected to Ray for the block: `address` ('auto', HOST:PORT, ray://…) joins a running
    cluster; None starts a local instance with `num_cpus` CPUs (its files under $RAY_TMPDIR,
    else $TMPDIR), shut down on exit with every process it started. Yields whether this
    call started the instance."""
    ray = import_ray()
    if ray.is_initialized():  # a caller's own session: use it, leave it
        yield False
        return
    with _loopback_only(address is None):
        yield from _session(ray, address, num_cpus, namespace, echo)


def _session(ray, address: str | None, num_cpus: int, namespace: str | None, echo):
    options: dict[str, Any] = {"namespace": namespace, "log_to_driver": False}
    if address is None:
        options |= {"num_cpus": num_cpus, "include_dashboard": False,
                    "_temp_dir": _ray_temp_dir()}  # fmt: skip
    try:
        ray.init(address=address, **options)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        where = "a local instance" if address is None else f"the Ray cluster at {address!r}"
        raise GagpoError(
            f"cannot connect to {where} ({str(exc).splitlines()[0][:200]}); accepted: --ray "
            "auto with a running cluster (ray start --head), --ray HOST:PORT, or --ray alone"
        ) from None
    if echo is not None:
        started = "started a local Ray instance" if address is None else "joined Ray cluster"
        echo(f"ray: {started} at {ray.get_runtime_context().gcs_address}")
    try:
        yield address is None
    finally:
        ray.shutdown()  # a local instance: its processes end with it


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_only(local: bool):
    """For the block, a local instance listens on 127.0.0.1 only. Ray's single-machine mode
    (its default on macOS, `LOOPBACK_ENV` = 0) takes the loopback address as the node's, and
    its GCS, raylet and workers bind to the node's address; the processes Ray starts inherit
    the variable. Ray reads it once, on import, so the imported constant is set too; both
    are put back after, so a later session here may join a cluster."""
    from ray._private import ray_constants

    before = (os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER)
    if local:
        os.environ[LOOPBACK_ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if before[0] is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = before[0]
        ray_constants.ENABLE_RAY_CLUSTER = before[1]


def _ray_temp_dir() -> str:
    """Where a local instance keeps its sessions: $RAY_TMPDIR, else $TMPDIR/ray (absolute).
    Ray's Unix sockets must fit in 107 bytes, so a deep TMPDIR falls back to /tmp/ray."""
    import tempfile

    root = os.environ.get("RAY_TMPDIR") or os.path.join(tempfile.gettempdir(), "ray")
    root = os.path.abspath(root)
    if len(root) > 60:
        root = "/tmp/ray"
    os.makedirs(root, exist_ok=True)
    return root

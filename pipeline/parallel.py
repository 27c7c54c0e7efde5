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
import socket
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
        from gagpo.storage.store import Store

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
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(threads,),
        )
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
    def get():
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            # Our own one-line error raised in the task: the line, not Ray's traceback of it.
            if isinstance(exc.cause, GagpoError):
                raise exc.cause from None
            raise

    return get


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
    if address is not None:  # a typo must not wait on Ray's own retries (minutes)
        probe_address(address)
    with _loopback_only(address is None):
        yield from _session(ray, address, num_cpus, namespace, echo)


def _session(ray, address: str | None, num_cpus: int, namespace: str | None, echo):
    options: dict[str, Any] = {"namespace": namespace, "log_to_driver": False}
    if address is None:
        options |= {"num_cpus": num_cpus, "include_dashboard": False, "_temp_dir": _ray_temp_dir()}
    try:
        with _bounded_join(address), _keep_sigterm():
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


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _keep_sigterm():
    """SIGTERM handled as before ray.init, or as Ctrl-C when it was not handled. ray.init
    installs its own handlers (Python's `sys.exit`, then the core worker's native one, which
    dumps a backtrace and aborts): a driver stopped with SIGTERM would end with no cleanup,
    its Ray actors and a local instance's agents left running. As KeyboardInterrupt, SIGTERM
    unwinds the caller's `finally` blocks and this session's `ray.shutdown()`."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if callable(before) else _interrupt)


# --- a cluster's address, checked before Ray is asked to join it ------------------------------

PROBE_TIMEOUT_S = 5.0  # each step of the probe: resolving, connecting, the gRPC handshake
JOIN_TIMEOUT_S = 90.0  # ray.init joining a cluster that passed the probe
ADDRESS_HELP = (
    "accepted: --ray auto with a running cluster (ray start --head), --ray HOST:PORT "
    "of its head (port 1-65535, 6379 by default), or --ray alone"
)
# An HTTP/2 client's connection preface and an empty SETTINGS frame. Ray's GCS (and the Ray
# Client server of ray://) is a gRPC server: it answers with a SETTINGS frame at once.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_SETTINGS = 0x4


def probe_address(address: str) -> None:
    """One line unless `address` answers as a Ray cluster's head, within a few seconds.

    ray.init on an address where nothing listens, that does not resolve, or whose port is
    out of range retries for many minutes without a word. So first: parse HOST:PORT ('auto':
    the cluster Ray would find, $RAY_ADDRESS or the last `ray start` here), resolve the host,
    connect, and check that a gRPC server answers there (the GCS is one)."""
    target = address.removeprefix("ray://")
    if target == "auto":
        target = _auto_address()
    host, port = _host_port(address, target)
    try:
        infos = _resolve(host, port)
    except OSError as exc:
        raise GagpoError(
            f"--ray {address!r}: host {host!r} does not resolve ({_reason(exc)}); {ADDRESS_HELP}"
        ) from None
    errors = []
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(PROBE_TIMEOUT_S)
            try:
                sock.connect(where)
            except OSError as exc:
                errors.append(_reason(exc))
                continue
            if _speaks_grpc(sock):
                return
            raise GagpoError(
                f"--ray {address!r}: something listens at {host}:{port} but it is not a Ray "
                f"cluster (no gRPC answer within {PROBE_TIMEOUT_S:g} s); {ADDRESS_HELP}"
            )
    raise GagpoError(
        f"--ray {address!r}: no Ray cluster answers at {host}:{port} "
        f"({errors[0] if errors else 'no address'}); {ADDRESS_HELP}"
    )


def _auto_address() -> str:
    """What `ray.init('auto')` would join: $RAY_ADDRESS, else the last cluster started here."""
    from ray._private import services

    try:
        found = services.canonicalize_bootstrap_address("auto")
    except (ConnectionError, ValueError) as exc:
        raise GagpoError(
            f"--ray 'auto': no running Ray cluster found ({_reason(exc)}); {ADDRESS_HELP}"
        ) from None
    if not found:
        raise GagpoError(f"--ray 'auto': no running Ray cluster found; {ADDRESS_HELP}")
    return found


def _host_port(address: str, target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise GagpoError(
            f"--ray {address!r} is not HOST:PORT with a port in 1-65535; {ADDRESS_HELP}"
        )
    return host, int(port)


def _resolve(host: str, port: int) -> list:
    """getaddrinfo, bounded: a resolver that does not answer would block for long."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gagpo-resolve")
    try:
        future = pool.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        return future.result(timeout=2 * PROBE_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        raise OSError(f"no answer from the resolver within {2 * PROBE_TIMEOUT_S:g} s") from None
    finally:
        pool.shutdown(wait=False)


def _speaks_grpc(sock: socket.socket) -> bool:
    """Whether the peer answers an HTTP/2 preface with a SETTINGS frame (gRPC does)."""
    try:
        sock.sendall(_H2_PREFACE)
        head = b""
        while len(head) < 9:  # a frame header: length (3), type (1), flags (1), stream (4)
            chunk = sock.recv(9 - len(head))
            if not chunk:
                return False
            head += chunk
    except OSError:
        return False
    return head[3] == _H2_SETTINGS


def _reason(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


@contextlib.contextmanager
def _bounded_join(address: str | None):
    """ray.init joining a cluster, bounded: a head that passed the probe and then never
    completes the join (Ray retries for minutes, in native code that no signal interrupts)
    ends the process with one line and exit code 2. Nothing of the run has started yet. A
    local instance being started is not bounded: a slow machine may need long."""
    if address is None:
        yield
        return
    import sys
    import threading

    def give_up() -> None:
        sys.stderr.write(
            f"gagpo: error: --ray {address!r}: the Ray cluster did not accept "
            f"this driver within {JOIN_TIMEOUT_S:g} s; {ADDRESS_HELP}\n"
        )
        sys.stderr.flush()
        os._exit(2)

    timer = threading.Timer(JOIN_TIMEOUT_S, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


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

"""`gagpo run --ray [ADDRESS]`: the same plan as `gagpo run` (workflows/layout.py), its
processes placed by a Ray cluster instead of started here (docs/cluster.md).

Each process of the plan (every actor, every learner rank) is held by a Ray actor, a
`ProcessHost` (`RankHost` for a rank), that runs the plan's own command line
(`python -m gagpo.actors.cli …`, `… gagpo.learner.cli …`) as its child process. A child
rather than `run_actor` called inside the Ray actor, because:

- it is exactly the code `gagpo-actors` and `gagpo-learner` run, CLI checks and signal
  handling included, and the commands are the ones `--dry-run` prints;
- a stop is graceful: SIGTERM lets an actor finish and commit its group, SIGINT stops the
  learner between updates. Killing a Ray actor mid-call could do neither;
- torch, vLLM and CUDA live and die with the child, never in a Ray worker that Ray reuses.

The child dies with its host (PR_SET_PDEATHSIG), so a Ray actor killed or lost takes its
process with it. Ray places the hosts with two placement groups (workflows/ray_placement.py):
the actors' (SPREAD, a bundle per actor) and the learner's (a bundle per node its ranks use:
STRICT_PACK on one node, STRICT_SPREAD over several). Each learner rank is a `RankHost` of its
own running the learner's command line with the rendezvous the driver reads from where the
ranks landed (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK: no torchrun). Ray sets each
host's CUDA_VISIBLE_DEVICES; the plan's physical GPU ids are not used, and the GPU counts are
checked against the cluster's resources before anything starts.

Faults. A dead actor host is restarted by Ray (max_restarts = run.actor_restarts); an actor
process that exits by itself is restarted by its host, within the same bound. Every restart
plays under a fresh run id and a seed no other incarnation uses (`restarted_command`), so no
group repeats. A learner that fails (a rank's process exits non-zero, or a rank's host died)
is stopped on every rank and started again, every rank with `--resume` and a fresh port
(run.learner_restarts), continuing its lineage. Restarts are written to
STORE/ray/restarts-<run id>.parquet. When the run ends, or on Ctrl-C, every process is stopped
as `gagpo run` stops them, every Ray actor and placement group this run made are removed, and
a local instance started here is shut down with all its processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass

from gagpo.schemas.errors import GagpoError
from gagpo.workflows.layout import SEED_STRIDE, Plan, Process
from gagpo.workflows.ray_placement import (
    ACTORS_STRATEGY,
    Placement,
    RankPlace,
    check_cluster,
    describe,
    describe_resources,
    place,
    rendezvous,
)

NAMESPACE = "gagpo"
POLL_S = 0.5  # seconds between two rounds of log relay and liveness checks
PLACE_TIMEOUT_S = 300.0  # a placement group not placed by then: the cluster is too small
PR_SET_PDEATHSIG = 1


# --- the command lines of restarted processes --------------------------------------------


def restarted_command(command: list[str], incarnation: int, actors: int, run_id: str) -> list[str]:
    """An actor's command line for its `incarnation`-th start (0: the plan's own): a fresh
    run id, and a seed past every other incarnation's. Actor i plays seeds from
    seed + i·SEED_STRIDE (layout.py); its r-th restart from seed + (i + r·actors)·SEED_STRIDE,
    a range no other actor and no other incarnation plays."""
    if incarnation == 0:
        return list(command)
    cmd = list(command)
    seed = cmd.index("--seed") + 1
    cmd[seed] = str(int(cmd[seed]) + incarnation * actors * SEED_STRIDE)
    cmd[cmd.index("--run-id") + 1] = run_id
    return cmd


def resumed_command(command: list[str]) -> list[str]:
    """The learner's command line again, continuing the store's lineage."""
    return command if "--resume" in command else [*command, "--resume"]


# --- inside the cluster: one Ray actor per process -----------------------------------------


def _libc_prctl():
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


_PRCTL = _libc_prctl()  # looked up before fork: the child only calls it


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the host process dies, however it dies; and
    SIGINT deliverable again. Ray starts its processes with SIGINT blocked, a mask its
    workers pass on through exec, so without this a learner would never see the SIGINT that
    stops it between updates (it would be killed after stop_timeout_s instead)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@dataclass
class HostState:
    """What a host reports on each poll."""

    lines: list[str]
    returncode: int | None  # of its process; None while it runs (or before it started)
    incarnation: int
    pid: int
    node: str


class Incarnations:
    """A Ray actor counting the starts of each process of the run, across the restarts of
    their hosts (a restarted Ray actor keeps no state of its own), and recording each
    restart: (process, incarnation, its run id, why, when)."""

    def __init__(self) -> None:
        self.starts: dict[str, int] = {}
        self.events: list[dict] = []

    def next(self, label: str, run_id: str, cause: str) -> int:
        self.starts[label] = self.starts.get(label, 0) + 1
        incarnation = self.starts[label] - 1
        if incarnation:
            self.events.append({"process": label, "incarnation": incarnation, "run_id": run_id,
                                "cause": cause, "at": time.time()})  # fmt: skip
        return incarnation

    def restarts(self) -> list[dict]:
        return list(self.events)


class _Child:
    """A host's child process: its output kept for the driver's polls, stopped on demand.
    Every method runs on the host's main thread (a plain, non-threaded Ray actor), the thread
    the child's death signal is tied to."""

    def _init_child(self, cwd: str) -> None:
        import ray

        self.cwd = cwd
        self.node = ray.util.get_node_ip_address()
        self._lock = threading.Lock()
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self.incarnation = -1

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace",
            cwd=self.cwd if os.path.isdir(self.cwd) else None, preexec_fn=_die_with_parent,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._relay, args=(self.proc,), daemon=True)
        self._reader.start()

    def _relay(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._say(line.rstrip())

    def _say(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)

    def poll(self) -> HostState:
        with self._lock:
            lines, self.lines = self.lines, []
        if self.proc is None:
            return HostState(lines, None, self.incarnation, 0, self.node)
        return HostState(lines, self.proc.poll(), self.incarnation, self.proc.pid, self.node)

    def stop(self, sig: int, timeout: float) -> HostState:
        """`sig` to the process if it runs; SIGKILL after `timeout` seconds."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        return self.poll()


class ProcessHost(_Child):
    """A Ray actor holding one actor process of the plan: it starts the command line when
    created (again after Ray restarted it, as a fresh incarnation) and after the process
    ended by itself (`restart`)."""

    def __init__(self, process: Process, cwd: str, counter, actors: int):
        self._init_child(cwd)
        self.process, self.counter, self.actors = process, counter, actors
        self._start("its Ray actor died and Ray restarted it")

    def _start(self, cause: str) -> None:
        import ray

        run_id = _new_run_id()
        self.incarnation = ray.get(self.counter.next.remote(self.process.label, run_id, cause))
        cmd = restarted_command(self.process.command, self.incarnation, self.actors, run_id)
        # Ray chose this host's GPUs (CUDA_VISIBLE_DEVICES): the plan's physical ids do not apply.
        self._spawn(cmd, {k: v for k, v in self.process.env.items() if k != "CUDA_VISIBLE_DEVICES"})
        self._say(
            f"(ray) started pid {self.proc.pid} on node {self.node}"
            + (f", restart {self.incarnation}: {_flags(cmd)}" if self.incarnation else "")
        )

    def restart(self) -> HostState:
        """Start the process again (it ended by itself), as its next incarnation."""
        code = self.proc.poll()
        self._reader.join(timeout=5)
        self._start(f"its process exited with {code}")
        return self.poll()


class RankHost(_Child):
    """A Ray actor holding one rank of the learner. It starts nothing by itself: the driver
    reads where every rank landed (`where`), gives each its rendezvous and starts them all
    (`launch`), and again with --resume after a failure (a restarted host waits likewise)."""

    def __init__(self, cwd: str):
        self._init_child(cwd)

    def where(self) -> RankPlace:
        import ray

        return RankPlace(self.node, tuple(str(g) for g in ray.get_gpu_ids()))

    def free_port(self) -> int:
        """A TCP port free on this node now, for rank 0's rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def launch(self, cmd: list[str], env: dict[str, str], incarnation: int, rank: int,
               world: int) -> HostState:  # fmt: skip
        self.stop(signal.SIGKILL, 1.0)  # a previous incarnation's process, if any is left
        self.incarnation = incarnation
        self._spawn(cmd, env)
        where = ""
        if world > 1:
            where = f" (rank {rank}/{world}, rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']})"
        self._say(
            f"(ray) started pid {self.proc.pid} on node {self.node}"
            + where
            + (f", restart {incarnation}: {_flags(cmd)}" if incarnation else "")
        )
        return self.poll()


def _new_run_id() -> str:
    from gagpo.schemas.store import new_id

    return new_id()


def _flags(cmd: list[str]) -> str:
    shown = [f"{flag} {cmd[cmd.index(flag) + 1]}" for flag in ("--run-id", "--seed")
             if flag in cmd]  # fmt: skip
    return " ".join(shown + (["--resume"] if "--resume" in cmd else []))


# --- the driver ------------------------------------------------------------------------------


RESTART_COLUMNS = ("process", "incarnation", "run_id", "cause", "at")


def cluster_resources(ray) -> tuple[dict[str, float], list[dict]]:
    """The cluster's resources in all, and each alive node's."""
    nodes = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    return dict(ray.cluster_resources()), nodes


def local_cpus() -> int:
    """The CPUs of a local instance started for a run: this machine's. Ray places a process
    per CPU of its bundle, so a plan of more processes than that is refused (check_cluster)
    rather than started on an instance that pretends to hold it."""
    return os.cpu_count() or 1


def local_resources() -> tuple[dict[str, float], list[dict]]:
    """What a local instance started here would have, read without starting Ray: this
    machine's CPUs (`local_cpus`) and the GPUs Ray itself would detect."""
    gpus = 0.0
    with contextlib.suppress(Exception):
        from ray._private.accelerators import get_accelerator_manager_for_resource

        gpus = float(
            get_accelerator_manager_for_resource("GPU").get_current_node_num_accelerators()
        )
    node = {"CPU": float(local_cpus()), "GPU": gpus}
    return dict(node), [node]


def _resources(address: str | None, config, plan: Plan):
    """(placement, total, nodes) for `address`: a running cluster (connected to for the
    read, then left), or this machine for a local instance (Ray not started)."""
    if address is None:
        total, nodes = local_resources()
    else:
        from gagpo.pipeline.parallel import ray_session

        with ray_session(address, num_cpus=1, namespace=NAMESPACE) as _:
            import ray

            total, nodes = cluster_resources(ray)
    return _place_on(plan, config, nodes), total, nodes


def _place_on(plan: Plan, config, nodes: list[dict]) -> Placement:
    """The placement of `plan` on nodes with these resources (each node's GPUs)."""
    return place(plan, config.learner_nodes, [n.get("GPU", 0.0) for n in nodes])


def check_on_ray(plan: Plan, config, address: str | None) -> None:
    """Before anything starts: the cluster (or this machine) can hold the placement."""
    placement, total, nodes = _resources(address, config, plan)
    check_cluster(placement, total, nodes, _where(address))


def _where(address: str | None) -> str:
    return "this machine (for a local Ray instance)" if address is None else "the Ray cluster"


def describe_on_ray(plan: Plan, config, address: str | None, echo) -> None:
    """`gagpo run --dry-run --ray`: the placement, then its check (one line, as the run
    would refuse it), and nothing started."""
    placement, total, nodes = _resources(address, config, plan)
    where = "this machine (no Ray started)" if address is None else f"the cluster at {address}"
    echo(describe(plan, placement, f"{where}: {describe_resources(total, nodes)}"))
    try:
        check_cluster(placement, total, nodes, _where(address))
    except GagpoError as exc:
        raise GagpoError(f"cannot be placed: {exc}") from None


@dataclass
class _Held:
    label: str
    handle: object
    rank: int | None = None  # a learner rank; None for an actor
    poll: object = None  # the poll in flight
    gone: bool = False
    last: str = ""  # the last line its process printed
    code: int | None = None  # its process's exit code, once gone after exiting by itself


def run_on_ray(plan: Plan, config, echo, *, address: str | None, store: str, run_id: str) -> int:
    """Run the plan's processes on Ray (`address` None: a local instance started here);
    return the learner's exit code. Everything this run started on Ray is removed before
    returning, interrupted or not; the restarts are written to the store."""
    from gagpo.pipeline.parallel import ray_session

    with ray_session(address, num_cpus=local_cpus(), namespace=NAMESPACE, echo=echo):
        import ray

        check_store_shared(ray, store)
        total, nodes = cluster_resources(ray)
        placement = _place_on(plan, config, nodes)
        check_cluster(placement, total, nodes, _where(address))
        return _run_placed(ray, plan, placement, config, echo, store, run_id)


def _run_placed(
    ray, plan: Plan, placement: Placement, config, echo, store: str, run_id: str
) -> int:
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    name = f"gagpo-{run_id}"
    groups = [placement_group(placement.learner_bundles, strategy=placement.learner_strategy,
                              name=f"{name}-learner")]  # fmt: skip
    if placement.actor_bundles:  # none in a plan of the learner alone (a test's)
        groups.append(placement_group(placement.actor_bundles, strategy=ACTORS_STRATEGY,
                                      name=f"{name}-actors"))  # fmt: skip
    held: list[_Held] = []
    counter = None
    learner = None
    try:
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups),
                            timeout=PLACE_TIMEOUT_S)  # fmt: skip
        if len(ready) < len(groups):
            raise GagpoError(
                f"the Ray cluster cannot place this run within {PLACE_TIMEOUT_S:g} s: it needs "
                f"{placement.actor_bundles} ({ACTORS_STRATEGY}) and {placement.learner_bundles} "
                f"({placement.learner_strategy}) and has {ray.cluster_resources()}; accepted: a "
                "cluster with those resources, or fewer actors (--actors, [run] actor_gpus)"
            )
        counter = ray.remote(Incarnations).options(num_cpus=0, name=f"{name}-starts").remote()
        actor_host, rank_host = ray.remote(ProcessHost), ray.remote(RankHost)
        for i, p in enumerate(plan.actors):
            bundle = placement.actor_bundles[i]
            handle = actor_host.options(
                name=f"{name}-{p.label.replace(' ', '-')}", num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0.0), max_restarts=config.actor_restarts,
                max_task_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(groups[1], i),
            ).remote(p, os.getcwd(), counter, len(plan.actors))  # fmt: skip
            held.append(_Held(p.label, handle))
        for rank in range(placement.ranks):
            handle = rank_host.options(
                name=f"{name}-learner" + (f"-rank-{rank}" if rank else ""), num_cpus=1,
                num_gpus=placement.rank_gpu, max_restarts=config.learner_restarts,
                max_task_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    groups[0], placement.rank_bundle(rank)),
            ).remote(os.getcwd())  # fmt: skip
            held.append(_Held("learner" if not rank else f"learner rank {rank}", handle, rank))
        names = ", ".join(f"{name}-{h.label.replace(' ', '-')}" for h in held)
        echo(f"ray: {len(plan.actors)} actor(s) and the learner ({placement.ranks} rank(s) on "
             f"{placement.learner_nodes} node(s)) placed (placement groups "
             f"{name}-learner{f', {name}-actors' if len(groups) > 1 else ''}; Ray actors {names})")  # fmt: skip
        learner = _Learner([h for h in held if h.rank is not None], plan.learner, placement,
                           config.learner_restarts, echo)  # fmt: skip
        learner.launch(ray, None)
        return _supervise(ray, held, learner, config, echo)
    finally:
        # Ended or interrupted: the learner stops between updates (SIGINT), then the actors
        # finish their groups (SIGTERM), as gagpo run stops them; then every Ray actor and
        # the placement groups of this run go.
        with contextlib.suppress(KeyboardInterrupt):
            _stop_all(ray, held, config, echo)
        if counter is not None:
            with contextlib.suppress(Exception):
                events = ray.get(counter.restarts.remote(), timeout=10)
                events += learner.events if learner is not None else []
                echo(_restarts_text(events))
                write_restarts(store, run_id, events)
        for h in held:
            with contextlib.suppress(Exception):
                ray.kill(h.handle, no_restart=True)
        if counter is not None:
            with contextlib.suppress(Exception):
                ray.kill(counter, no_restart=True)
        for group in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)


class _Learner:
    """The learner's ranks, one RankHost each: started together with their rendezvous, and
    restarted together (with --resume, a fresh port) when one fails or its host dies, as
    torchrun fails the job when one rank does."""

    def __init__(self, hosts: list[_Held], process: Process, placement: Placement,
                 restarts: int, echo):  # fmt: skip
        self.hosts, self.placement, self.restarts, self.echo = hosts, placement, restarts, echo
        self.command = list(process.per_rank)
        # Ray chose each host's GPUs: the plan's physical ids do not apply.
        self.env = {k: v for k, v in process.env.items() if k != "CUDA_VISIBLE_DEVICES"}
        self.incarnation = -1
        self.codes: list[int | None] = []
        self.events: list[dict] = []

    def launch(self, ray, cause: str | None) -> None:
        self.incarnation += 1
        if cause is not None:
            self.events.append({"process": "learner", "incarnation": self.incarnation,
                                "run_id": None, "cause": cause, "at": time.time()})  # fmt: skip
        cmd = resumed_command(self.command) if self.incarnation else self.command
        world = self.placement.ranks
        places = ray.get([h.handle.where.remote() for h in self.hosts], timeout=PLACE_TIMEOUT_S)
        envs = [{}]
        if world > 1:
            port = ray.get(self.hosts[0].handle.free_port.remote(), timeout=60)
            envs = rendezvous(places, self.placement.per_node, port)
        states = ray.get([h.handle.launch.remote(cmd, self.env | env, self.incarnation, h.rank, world)
                          for h, env in zip(self.hosts, envs, strict=True)], timeout=PLACE_TIMEOUT_S)  # fmt: skip
        for h, state in zip(self.hosts, states, strict=True):
            for line in state.lines:
                self.echo(f"[{h.label}] {line}")
        self.codes = [None] * world

    def ended(self, rank: int, state: HostState) -> int | None:
        """A rank's process ended: the learner's exit code when the learner is over."""
        from gagpo.learner.cli import EXIT_STOPPED_EARLY

        if state.incarnation != self.incarnation:
            return None  # a previous incarnation's process, stopped on purpose
        self.codes[rank] = state.returncode
        if state.returncode in (0, EXIT_STOPPED_EARLY):
            done = all(c is not None for c in self.codes)
            return self.codes[0] if done else None
        return self.failed(f"rank {rank}'s process exited with {state.returncode}",
                           state.returncode)  # fmt: skip

    def failed(self, cause: str, code: int):
        """One rank failed: every rank stops; the learner starts again if it may."""
        import ray

        if self.incarnation >= self.restarts:
            self.echo(f"[learner] (ray) {cause}; no restart left (run.learner_restarts)")
            return code
        self.echo(f"[learner] (ray) {cause}; every rank restarts with --resume")
        for h in self.hosts:
            h.poll = None
            with contextlib.suppress(Exception):  # a dead host: Ray restarts it, it waits
                ray.get(h.handle.stop.remote(signal.SIGTERM, 10.0), timeout=60)
        try:
            self.launch(ray, cause)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            self.echo(f"[learner] (ray) cannot start its ranks again ({type(exc).__name__})")
            return code or 1
        return None


def _supervise(ray, held: list[_Held], learner: _Learner, config, echo) -> int:
    """Relay every host's output until the learner ends; restart what ended by itself."""
    from ray.exceptions import ActorDiedError, RayActorError

    actors = [h for h in held if h.rank is None]
    while True:
        for h in held:
            if h.poll is None and not h.gone:
                h.poll = h.handle.poll.remote()
        pending = [h.poll for h in held if h.poll is not None]
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=2 * POLL_S)
        for h in held:
            if h.poll is None or h.poll not in ready:
                continue  # a host Ray is restarting answers once it is back
            ref, h.poll = h.poll, None
            try:
                state: HostState = ray.get(ref)
            except ActorDiedError:  # for good: its restarts are spent
                h.gone = True
                echo(f"[{h.label}] (ray) died and will not be restarted "
                     "(run.actor_restarts / run.learner_restarts spent)")  # fmt: skip
                if h.rank is not None:
                    return 1
                if all(x.gone for x in actors):
                    echo("ray: every actor is gone; the learner is stopped")
                    return 1
                continue
            except RayActorError:  # it died; Ray is restarting it (a new incarnation)
                echo(f"[{h.label}] (ray) died; Ray restarts it")
                if h.rank is not None and (code := learner.failed(
                        f"rank {h.rank}'s Ray actor died", 1)) is not None:  # fmt: skip
                    return code
                continue
            for line in state.lines:
                echo(f"[{h.label}] {line}")
                if line.strip() and not line.startswith("(ray) "):
                    h.last = line.strip()
            if state.returncode is None:
                continue
            if h.rank is not None:
                if (code := learner.ended(h.rank, state)) is not None:
                    return code
                continue
            if state.incarnation >= config.actor_restarts:
                h.gone, h.code = True, state.returncode
                echo(f"[{h.label}] (ray) exited with {state.returncode}; no restart left")
                if all(x.gone for x in actors):
                    if all(x.code for x in actors):  # each said why: that is the run's line
                        raise GagpoError(_actors_failed(actors))
                    echo("ray: every actor is gone; the learner is stopped")
                    return 1
                continue
            echo(f"[{h.label}] (ray) exited with {state.returncode}; restarting it")
            h.poll = h.handle.restart.remote()
        time.sleep(POLL_S)


def _actors_failed(actors: list[_Held]) -> str:
    said: dict[str, list[str]] = {}
    for h in actors:
        said.setdefault(f"exited with {h.code}: {h.last or 'no output'}", []).append(h.label)
    why = "; ".join(f"{', '.join(who)} {what}" for what, who in said.items())
    return (f"every actor exited with an error (restarts included), so the learner was "
            f"stopped; {why}")  # fmt: skip


def _stop_all(ray, held: list[_Held], config, echo) -> None:
    ranks = [h for h in held if h.rank is not None]
    actors = [h for h in held if h.rank is None]
    for group, sig in ((ranks, signal.SIGINT), (actors, signal.SIGTERM)):
        refs = [(h, h.handle.stop.remote(sig, config.stop_timeout_s)) for h in group]
        for h, ref in refs:
            try:
                state = ray.get(ref, timeout=config.stop_timeout_s + 30)
            except Exception:  # dead or unreachable: ray.kill below ends it and its child
                continue
            for line in state.lines:
                echo(f"[{h.label}] {line}")


# --- restarts, in the closing lines and in the store ----------------------------------------


def _restarts_text(events: list[dict]) -> str:
    learner = sum(1 for e in events if e["process"] == "learner")
    each: dict[str, int] = {}
    for e in events:
        each[e["process"]] = each.get(e["process"], 0) + 1
    listed = ", ".join(f"{label} ×{n}" for label, n in sorted(each.items()))
    return (f"ray: {len(events) - learner} actor restart(s), {learner} learner restart(s)"
            + (f" ({listed})" if listed else ""))  # fmt: skip


def restarts_path(store, run_id: str) -> str:
    from gagpo.schemas import layout

    return layout.restarts(store.root, run_id)


def write_restarts(store_url: str, run_id: str, events: list[dict]) -> None:
    """STORE/ray/restarts-<run id>.parquet: one row per restart of this run (none: an empty
    file, so a run without restarts says so too), committed atomically as every file."""
    import pyarrow as pa

    from gagpo.schemas.store import Store

    store = Store(store_url)
    schema = pa.schema([("process", pa.string()), ("incarnation", pa.int32()),
                        ("run_id", pa.string()), ("cause", pa.string()),
                        ("at", pa.timestamp("ms", tz="UTC"))])  # fmt: skip
    rows = sorted(events, key=lambda e: e["at"])
    table = pa.table({"process": [e["process"] for e in rows],
                      "incarnation": [e["incarnation"] for e in rows],
                      "run_id": [e["run_id"] for e in rows], "cause": [e["cause"] for e in rows],
                      "at": [int(e["at"] * 1000) for e in rows]}, schema=schema)  # fmt: skip
    store.write_parquet(
        table, restarts_path(store, run_id), {b"gagpo.launch_run_id": run_id.encode()}
    )


def restarts_line(store_url: str, run_id: str) -> str:
    """The closing line of a Ray run, read back from what the run wrote to the store."""
    from gagpo.schemas.store import Store

    store = Store(store_url)
    path = restarts_path(store, run_id)
    if not store.exists(path):
        return "ray restarts: not recorded (the run ended before its Ray actors started)"
    rows = store.read_table(path).to_pylist()
    return _restarts_text(rows).replace("ray: ", "ray restarts: ", 1) + f"; recorded in {path}"


def check_store_shared(ray, store: str) -> None:
    """On a cluster of several nodes the store must be one every node reaches: an object
    store, or a local path every node sees (a shared file system, checked with a probe
    file). Anything else is refused in one line before any process starts."""
    from gagpo.schemas.store import Store

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    opened = Store(store)
    if len(nodes) < 2 or not opened.is_local:
        return
    probe = opened.path(f".ray-probe-{uuid.uuid4().hex}")
    opened.commit_bytes(probe, b"gagpo")
    try:
        seen = _probe_nodes(ray, nodes, probe)
    finally:
        with contextlib.suppress(Exception):
            opened.remove(probe)
    if not all(seen):
        raise GagpoError(
            f"store {store!r} is a local path but the Ray cluster has {len(nodes)} nodes and "
            f"{seen.count(False)} of them cannot see it; accepted: a store every node reaches "
            "(s3://…, or a shared file system mounted at the same path on every node)"
        )


def _probe_nodes(ray, nodes: list[dict], probe: str) -> list[bool]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    exists = ray.remote(num_cpus=0)(os.path.exists)
    refs = [
        exists.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(probe)
        for n in nodes
    ]
    return list(ray.get(refs, timeout=120))

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

Faults. Ray restarts no host: the driver does, within the bounds of the recipe. An actor
whose host died (its node lost, or the host killed) gets a new host in its bundle, which Ray
places again on a node with room; an actor process that exits by itself is started again by
its host (run.actor_restarts, both). A learner that fails (a rank's process exits non-zero,
or a rank's host died) is stopped on every rank and started again, every rank with
`--resume` and a fresh port, continuing its lineage (run.learner_restarts); after a lost host
its ranks go to a new placement group on the nodes that remain. What no node holds within
run.place_timeout_s is lost: an actor is counted "lost, not replaced" and the run goes on; the
learner ends the run with one line naming what is missing. Every restart plays under a fresh
run id and a seed no other incarnation uses (`restarted_command`), so no group repeats.
Restarts and losses are written to STORE/ray/restarts-<run id>.parquet. When the run ends, or
on Ctrl-C or SIGTERM, every process is stopped as `gagpo run` stops them, every Ray actor and
placement group this run made are removed, and a local instance started here is shut down
with all its processes. A driver killed outright leaves nothing either: its Ray actors and
placement groups belong to its Ray job, which ends with it, and each host's process dies
with its host (or, on a local instance, with the instance, whose processes die with the driver).
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
    node: str  # its node's address
    node_id: str  # its node's Ray id: not among the alive nodes once the node is lost


class _Child:
    """A host's child process: its output kept for the driver's polls, stopped on demand.
    Every method runs on the host's main thread (a plain, non-threaded Ray actor), the thread
    the child's death signal is tied to."""

    def _init_child(self, cwd: str) -> None:
        import ray

        self.cwd = cwd
        self.node = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self._lock = threading.Lock()
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self.incarnation = -1

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            errors="replace",
            cwd=self.cwd if os.path.isdir(self.cwd) else None,
            preexec_fn=_die_with_parent,
        )
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
        proc = self.proc
        return HostState(
            lines,
            None if proc is None else proc.poll(),
            self.incarnation,
            0 if proc is None else proc.pid,
            self.node,
            self.node_id,
        )

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
    """A Ray actor holding one actor process of the plan: it starts the command line of its
    `incarnation` when created, and a later incarnation when the process ended by itself
    (`restart`). The driver numbers the incarnations and chooses their run ids: Ray restarts
    no host, and a host whose node was lost is a new Ray actor, placed again by the driver."""

    def __init__(self, process: Process, cwd: str, actors: int, incarnation: int, run_id: str):
        self._init_child(cwd)
        self.process, self.actors = process, actors
        self._start(incarnation, run_id)

    def _start(self, incarnation: int, run_id: str) -> None:
        self.incarnation = incarnation
        cmd = restarted_command(self.process.command, incarnation, self.actors, run_id)
        # Ray chose this host's GPUs (CUDA_VISIBLE_DEVICES): the plan's physical ids do not apply.
        self._spawn(cmd, {k: v for k, v in self.process.env.items() if k != "CUDA_VISIBLE_DEVICES"})
        self._say(
            f"(ray) started pid {self.proc.pid} on node {self.node}"
            + (f", restart {incarnation}: {_flags(cmd)}" if incarnation else "")
        )

    def restart(self, incarnation: int, run_id: str) -> HostState:
        """Start the process again (it ended by itself), as incarnation `incarnation`."""
        self._reader.join(timeout=5)
        self._start(incarnation, run_id)
        return self.poll()


class RankHost(_Child):
    """A Ray actor holding one rank of the learner. It starts nothing by itself: the driver
    reads where every rank landed (`where`), gives each its rendezvous and starts them all
    (`launch`), and again with --resume after a failure (on new hosts when a node was lost)."""

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

    def launch(
        self, cmd: list[str], env: dict[str, str], incarnation: int, rank: int, world: int
    ) -> HostState:
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
    from gagpo.storage.store import new_id

    return new_id()


def _flags(cmd: list[str]) -> str:
    shown = [f"{flag} {cmd[cmd.index(flag) + 1]}" for flag in ("--run-id", "--seed") if flag in cmd]
    return " ".join(shown + (["--resume"] if "--resume" in cmd else []))


# --- the driver ------------------------------------------------------------------------------


RESTART_COLUMNS = ("process", "incarnation", "run_id", "cause", "replaced", "at")


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
    """A host as the driver sees it, across the Ray actors that held its process."""

    label: str
    handle: object
    rank: int | None = None  # a learner rank; None for an actor
    bundle: int = 0  # its bundle in its placement group
    poll: object = None  # the poll in flight
    gone: bool = False
    last: str = ""  # the last line its process printed
    code: int | None = None  # its process's exit code, once gone after exiting by itself
    incarnation: int = 0  # the driver numbers them: Ray restarts no host
    node_id: str = ""  # where its host runs, from its last poll
    placing: tuple[float, str, str] | None = None  # (since, cause, run id) of a host placed again


def _event(
    process: str, incarnation: int, run_id: str | None, cause: str, replaced: bool = True
) -> dict:
    """A row of STORE/ray/restarts-<run id>.parquet: a restart, or a process lost for good."""
    return {
        "process": process,
        "incarnation": incarnation,
        "run_id": run_id,
        "cause": cause,
        "replaced": replaced,
        "at": time.time(),
    }


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
    events: list[dict] = []
    learner = _Learner(ray, name, plan.learner, placement, config, events, echo)
    groups = [learner.group]
    if placement.actor_bundles:  # none in a plan of the learner alone (a test's)
        groups.append(
            placement_group(
                placement.actor_bundles, strategy=ACTORS_STRATEGY, name=f"{name}-actors"
            )
        )
    actor_host = ray.remote(ProcessHost)

    def new_actor_host(h: _Held, run_id: str):
        """Actor h's host for its incarnation, in its bundle: after a node was lost, Ray
        places the bundle again on a node with room (now, or once the cluster has one)."""
        bundle = placement.actor_bundles[h.bundle]
        suffix = f"-r{h.incarnation}" if h.incarnation else ""
        return actor_host.options(
            name=f"{name}-{h.label.replace(' ', '-')}{suffix}",
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0.0),
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(groups[-1], h.bundle),
        ).remote(plan.actors[h.bundle], os.getcwd(), len(plan.actors), h.incarnation, run_id)

    actors: list[_Held] = []
    try:
        ready, _ = ray.wait(
            [g.ready() for g in groups], num_returns=len(groups), timeout=config.place_timeout_s
        )
        if len(ready) < len(groups):
            raise GagpoError(
                f"the Ray cluster cannot place this run within {config.place_timeout_s:g} s: it "
                f"needs {placement.actor_bundles} ({ACTORS_STRATEGY}) and {placement.learner_bundles} "
                f"({placement.learner_strategy}) and has {ray.cluster_resources()}; accepted: a "
                "cluster with those resources, or fewer actors (--actors, [run] actor_gpus)"
            )
        for i, p in enumerate(plan.actors):
            h = _Held(p.label, None, bundle=i)
            h.handle = new_actor_host(h, "")  # incarnation 0: the plan's own command line
            actors.append(h)
        learner.make_hosts()
        names = ", ".join(f"{name}-{h.label.replace(' ', '-')}" for h in actors + learner.hosts)
        echo(
            f"ray: {len(plan.actors)} actor(s) and the learner ({placement.ranks} rank(s) on "
            f"{placement.learner_nodes} node(s)) placed (placement groups "
            f"{name}-learner{f', {name}-actors' if len(groups) > 1 else ''}; Ray actors {names})"
        )
        learner.launch(None)
        return _supervise(ray, actors, learner, config, echo, events, new_actor_host)
    finally:
        # Ended or interrupted: the learner stops between updates (SIGINT), then the actors
        # finish their groups (SIGTERM), as gagpo run stops them; then every Ray actor and
        # the placement groups of this run go.
        with contextlib.suppress(KeyboardInterrupt):
            _stop_all(ray, actors, learner, config, echo)
        for h in actors:
            if h.placing is not None:  # placed again, and no node held it before the end
                events.append(
                    _event(
                        h.label,
                        h.incarnation,
                        None,
                        f"{h.placing[1]}; the run ended before a node could hold it",
                        replaced=False,
                    )
                )
        with contextlib.suppress(Exception):
            echo(_restarts_text(events))
            write_restarts(store, run_id, events)
        for h in actors + learner.hosts:
            with contextlib.suppress(Exception):
                ray.kill(h.handle, no_restart=True)
        for group in groups[1:] + learner.groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)


class _Learner:
    """The learner's ranks, one RankHost each, in a placement group of their own: started
    together with their rendezvous, and restarted together (with --resume, a fresh port)
    when one fails, as torchrun fails the job when one rank does. When a rank's host died
    (its node lost), the ranks go to a new placement group, on the nodes that remain."""

    def __init__(
        self,
        ray,
        name: str,
        process: Process,
        placement: Placement,
        config,
        events: list[dict],
        echo,
    ):
        self.ray, self.name, self.placement, self.echo = ray, name, placement, echo
        self.restarts, self.timeout = config.learner_restarts, config.place_timeout_s
        self.events = events
        self.command = list(process.per_rank)
        # Ray chose each host's GPUs: the plan's physical ids do not apply.
        self.env = {k: v for k, v in process.env.items() if k != "CUDA_VISIBLE_DEVICES"}
        self.incarnation = -1
        self.codes: list[int | None] = []
        self.hosts: list[_Held] = []
        self.groups: list = []  # every placement group made for it, the current one last
        self.group = self._new_group()

    def _new_group(self):
        from ray.util.placement_group import placement_group

        suffix = f"-r{self.incarnation + 1}" if self.groups else ""
        group = placement_group(
            self.placement.learner_bundles,
            name=f"{self.name}-learner{suffix}",
            strategy=self.placement.learner_strategy,
        )
        self.groups.append(group)
        return group

    def make_hosts(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rank_host = self.ray.remote(RankHost)
        suffix = f"-r{self.incarnation + 1}" if self.incarnation >= 0 else ""
        self.hosts = []
        for rank in range(self.placement.ranks):
            handle = rank_host.options(
                name=f"{self.name}-learner" + (f"-rank-{rank}" if rank else "") + suffix,
                num_cpus=1,
                num_gpus=self.placement.rank_gpu,
                max_restarts=0,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, self.placement.rank_bundle(rank)
                ),
            ).remote(os.getcwd())
            label = "learner" if not rank else f"learner rank {rank}"
            self.hosts.append(_Held(label, handle, rank))

    def launch(self, cause: str | None) -> None:
        ray = self.ray
        self.incarnation += 1
        if cause is not None:
            self.events.append(_event("learner", self.incarnation, None, cause))
        cmd = resumed_command(self.command) if self.incarnation else self.command
        world = self.placement.ranks
        places = ray.get([h.handle.where.remote() for h in self.hosts], timeout=self.timeout)
        envs = [{}]
        if world > 1:
            port = ray.get(self.hosts[0].handle.free_port.remote(), timeout=60)
            envs = rendezvous(places, self.placement.per_node, port)
        states = ray.get(
            [
                h.handle.launch.remote(cmd, self.env | env, self.incarnation, h.rank, world)
                for h, env in zip(self.hosts, envs, strict=True)
            ],
            timeout=self.timeout,
        )
        for h, state in zip(self.hosts, states, strict=True):
            h.node_id = state.node_id
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
        return self.failed(
            f"rank {rank}'s process exited with {state.returncode}", state.returncode
        )

    def failed(self, cause: str, code: int, host_lost: bool = False):
        """One rank failed (`host_lost`: its host died): every rank stops; the learner
        starts again if it may, on new hosts in a new placement group after a lost host."""
        ray = self.ray
        if self.incarnation >= self.restarts:
            self.echo(
                f"[learner] (ray) {cause}; no restart left (run.learner_restarts = {self.restarts})"
            )
            self.events.append(
                _event(
                    "learner",
                    self.incarnation + 1,
                    None,
                    f"{cause}; no restart left",
                    replaced=False,
                )
            )
            return code
        where = " on a new placement group" if host_lost else ""
        self.echo(f"[learner] (ray) {cause}; every rank restarts with --resume{where}")
        for h in self.hosts:
            h.poll = None
            with contextlib.suppress(Exception):  # a dead host answers at once with its death
                ray.get(h.handle.stop.remote(signal.SIGTERM, 10.0), timeout=60)
        if host_lost:
            self._place_again(cause)
        try:
            self.launch(cause)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            self.echo(f"[learner] (ray) cannot start its ranks again ({type(exc).__name__})")
            return code or 1
        return None

    def _place_again(self, cause: str) -> None:
        """New hosts in a new placement group of the same bundles, once the cluster holds it
        (an autoscaling cluster may add a node meanwhile); else one line naming what is missing."""
        from ray.util.placement_group import remove_placement_group

        ray = self.ray
        for h in self.hosts:
            with contextlib.suppress(Exception):
                ray.kill(h.handle, no_restart=True)
        with contextlib.suppress(Exception):  # its bundles elsewhere are free again
            remove_placement_group(self.group)
        self.group = self._new_group()
        needs = f"{self.placement.learner_bundles} ({self.placement.learner_strategy})"
        self.echo(
            f"[learner] (ray) waiting up to {self.timeout:g} s for the Ray cluster to hold {needs}"
        )
        ready, _ = ray.wait([self.group.ready()], timeout=self.timeout)
        if not ready:
            self.events.append(
                _event(
                    "learner",
                    self.incarnation + 1,
                    None,
                    f"{cause}; no node could hold it",
                    replaced=False,
                )
            )
            total, nodes = cluster_resources(ray)
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            raise GagpoError(
                f"the learner's host was lost ({cause}) and the Ray cluster could not place it "
                f"again within {self.timeout:g} s: it needs {needs}, and the cluster has "
                f"{_resources_text(free)} free of {describe_resources(total, nodes)}; accepted: "
                "a cluster with room for it (nodes added, or an autoscaling cluster), or a "
                "longer run.place_timeout_s"
            )
        self.make_hosts()


def _resources_text(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}(s)" for k, v in sorted(resources.items())) or "nothing"


def _death(ray, h: _Held) -> str:
    """Why a host died, as far as the driver can tell: its node lost, or the host itself."""
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    if h.node_id and h.node_id not in alive:
        return f"its node {h.node_id[:8]} was lost"
    return "its Ray actor died"


def _supervise(
    ray, actors: list[_Held], learner: _Learner, config, echo, events: list[dict], new_actor_host
) -> int:
    """Relay every host's output until the learner ends; restart what ended by itself, and
    place again what a lost node (or a killed host) took, within the restart bounds."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    while True:
        hosts = actors + learner.hosts
        for h in hosts:
            if h.poll is None and not h.gone:
                h.poll = h.handle.poll.remote()
        pending = [h.poll for h in hosts if h.poll is not None]
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=2 * POLL_S)
        for h in hosts:
            if h.poll is None or h.poll not in ready:
                continue  # a host not yet placed again answers once it is
            ref, h.poll = h.poll, None
            try:
                state: HostState = ray.get(ref)
            except ActorUnavailableError:
                continue  # unreachable for now: asked again next round
            except RayActorError:  # its host died; Ray restarts none, the driver decides
                if h.rank is None:
                    _actor_host_died(ray, h, _death(ray, h), config, echo, events, new_actor_host)
                    continue
                code = learner.failed(f"rank {h.rank}: {_death(ray, h)}", 1, host_lost=True)
                if code is not None:
                    return code
                break  # the learner's hosts are new ones: polled afresh
            h.node_id = state.node_id
            if h.placing is not None:  # a host placed again answers: the restart happened
                events.append(_event(h.label, h.incarnation, h.placing[2], h.placing[1]))
                h.placing = None
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
                if state.returncode:
                    events.append(
                        _event(
                            h.label,
                            h.incarnation + 1,
                            None,
                            f"its process exited with {state.returncode}; no restart left",
                            replaced=False,
                        )
                    )
                continue
            echo(f"[{h.label}] (ray) exited with {state.returncode}; restarting it")
            h.incarnation, run_id = h.incarnation + 1, _new_run_id()
            events.append(
                _event(
                    h.label, h.incarnation, run_id, f"its process exited with {state.returncode}"
                )
            )
            h.poll = h.handle.restart.remote(h.incarnation, run_id)
        _give_up_placing(ray, actors, config, echo, events)
        if actors and all(h.gone for h in actors):
            if all(h.code for h in actors):  # each said why: that is the run's line
                raise GagpoError(_actors_failed(actors))
            echo("ray: every actor is gone; the learner is stopped")
            return 1
        time.sleep(POLL_S)


def _actor_host_died(ray, h: _Held, cause: str, config, echo, events, new_actor_host) -> None:
    """An actor's host died (its node lost, or killed): a new host in its bundle, which Ray
    places again on a node with room, while restarts are left; else it is lost."""
    with contextlib.suppress(Exception):
        ray.kill(h.handle, no_restart=True)
    if h.incarnation >= config.actor_restarts:
        h.gone = True
        echo(
            f"[{h.label}] (ray) {cause}; lost, not replaced: no restart left "
            f"(run.actor_restarts = {config.actor_restarts})"
        )
        events.append(
            _event(h.label, h.incarnation + 1, None, f"{cause}; no restart left", replaced=False)
        )
        return
    h.incarnation, run_id = h.incarnation + 1, _new_run_id()
    h.handle = new_actor_host(h, run_id)
    h.placing = (time.monotonic(), cause, run_id)
    echo(
        f"[{h.label}] (ray) {cause}; placing it again (restart {h.incarnation} of "
        f"{config.actor_restarts}; up to {config.place_timeout_s:g} s for a node with room)"
    )


def _give_up_placing(ray, actors: list[_Held], config, echo, events) -> None:
    """An actor placed again that no node took within run.place_timeout_s is lost."""
    for h in actors:
        if h.placing is None or time.monotonic() - h.placing[0] < config.place_timeout_s:
            continue
        with contextlib.suppress(Exception):
            ray.kill(h.handle, no_restart=True)
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        echo(
            f"[{h.label}] (ray) lost, not replaced: no node could hold it within "
            f"{config.place_timeout_s:g} s (the cluster has {_resources_text(free)} free)"
        )
        events.append(
            _event(
                h.label,
                h.incarnation,
                None,
                f"{h.placing[1]}; no node could hold it within {config.place_timeout_s:g} s",
                replaced=False,
            )
        )
        h.gone, h.poll, h.placing = True, None, None


def _actors_failed(actors: list[_Held]) -> str:
    said: dict[str, list[str]] = {}
    for h in actors:
        said.setdefault(f"exited with {h.code}: {h.last or 'no output'}", []).append(h.label)
    why = "; ".join(f"{', '.join(who)} {what}" for what, who in said.items())
    return (
        f"every actor exited with an error (restarts included), so the learner was stopped; {why}"
    )


def _stop_all(ray, actors: list[_Held], learner: _Learner, config, echo) -> None:
    running = [h for h in actors if not h.gone and h.placing is None]
    for group, sig in ((learner.hosts, signal.SIGINT), (running, signal.SIGTERM)):
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
    """`ray: 1 actor restart(s), 1 learner restart(s), 0 lost (not replaced) (actor 0 ×1, …)`:
    restarts of actors and of the learner, and processes lost for good, counted apart."""
    restarted = [e for e in events if e.get("replaced", True)]
    lost = sorted(e["process"] for e in events if not e.get("replaced", True))
    learner = sum(1 for e in restarted if e["process"] == "learner")
    each: dict[str, int] = {}
    for e in restarted:
        each[e["process"]] = each.get(e["process"], 0) + 1
    details = [", ".join(f"{label} ×{n}" for label, n in sorted(each.items()))] if each else []
    if lost:
        details.append("lost: " + ", ".join(lost))
    return (
        f"ray: {len(restarted) - learner} actor restart(s), {learner} learner restart(s), "
        f"{len(lost)} lost (not replaced)" + (f" ({'; '.join(details)})" if details else "")
    )


def restarts_path(store, run_id: str) -> str:
    from gagpo.schemas import layout

    return layout.restarts(store.root, run_id)


def write_restarts(store_url: str, run_id: str, events: list[dict]) -> None:
    """STORE/ray/restarts-<run id>.parquet: one row per restart of this run, and per process
    lost for good (`replaced` false); none: an empty file, so a run without restarts says so
    too. Committed atomically as every file."""
    import pyarrow as pa

    from gagpo.storage.store import Store

    store = Store(store_url)
    schema = pa.schema(
        [
            ("process", pa.string()),
            ("incarnation", pa.int32()),
            ("run_id", pa.string()),
            ("cause", pa.string()),
            ("replaced", pa.bool_()),
            ("at", pa.timestamp("ms", tz="UTC")),
        ]
    )
    rows = sorted(events, key=lambda e: e["at"])
    table = pa.table(
        {name: [e[name] for e in rows] for name in RESTART_COLUMNS[:-1]}
        | {"at": [int(e["at"] * 1000) for e in rows]},
        schema=schema,
    )
    store.write_parquet(
        table, restarts_path(store, run_id), {b"gagpo.launch_run_id": run_id.encode()}
    )


def restarts_line(store_url: str, run_id: str) -> str:
    """The closing line of a Ray run, read back from what the run wrote to the store."""
    from gagpo.storage.store import Store

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
    from gagpo.storage.store import Store

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

"""The driver's loop of `gagpo run --ray`: the hosts placed (workflows/ray_host.py), their
output relayed, and the faults handled within the recipe's bounds (docs/cluster.md).

Ray restarts no host: the driver does. An actor whose host died (its node lost, or the host
killed) gets a new host in its bundle, which Ray places again on a node with room; an actor
process that exits by itself is started again by its host (run.actor_restarts, both). A
learner that fails (a rank's process exits non-zero, or a rank's host died) is stopped on
every rank and started again, every rank with `--resume` and a fresh port, continuing its
lineage (run.learner_restarts); after a lost host its ranks go to a new placement group on the
nodes that remain. What no node holds within run.place_timeout_s is lost: an actor is counted
"lost, not replaced" and the run goes on; the learner ends the run with one line naming what
is missing. Every restart plays under a fresh run id and a seed no other incarnation uses
(ray_host.restarted_command), so no group repeats. Each restart and loss is an event of the
restart record (workflows/ray_restarts.py). When the run ends, or is interrupted, every process is stopped
as `gagpo run` stops them, and every Ray actor and placement group of the run is removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

from gagpo.schemas.errors import GagpoError
from gagpo.schemas.layout import new_id
from gagpo.storage.store import Store
from gagpo.workflows.layout import Plan, Process
from gagpo.workflows.ray_host import HostState, ProcessHost, RankHost, resumed_command
from gagpo.workflows.ray_placement import (
    ACTORS_STRATEGY,
    Placement,
    describe_resources,
    rendezvous,
)
from gagpo.workflows.ray_restarts import event, restarts_text, write_restarts

POLL_S = 0.5  # seconds between two rounds of log relay and liveness checks


def cluster_resources(ray) -> tuple[dict[str, float], list[dict]]:
    """The cluster's resources in all, and each alive node's."""
    nodes = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    return dict(ray.cluster_resources()), nodes


@dataclass
class Held:
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


def run_placed(
    ray, plan: Plan, placement: Placement, config, echo, store: Store, run_id: str
) -> int:
    """The plan's processes in their placement groups, supervised until the learner ends;
    its exit code. Whatever happens, every process is stopped, the restarts are recorded in
    `store`, and every Ray actor and placement group of the run is removed."""
    from ray.util.placement_group import placement_group
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

    def new_actor_host(h: Held, run_id: str):
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

    actors: list[Held] = []
    try:
        _await_placement(ray, groups, placement, config)
        for i, p in enumerate(plan.actors):
            h = Held(p.label, None, bundle=i)
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
        _tear_down(ray, actors, learner, groups, config, echo, (events, store, run_id))


def _await_placement(ray, groups: list, placement: Placement, config) -> None:
    """Wait for every placement group, or stop with one line saying what the run needs."""
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


def _tear_down(ray, actors: list[Held], learner, groups: list, config, echo, record) -> None:
    """Ended or interrupted: the learner stops between updates (SIGINT), then the actors
    finish their groups (SIGTERM), as gagpo run stops them; an actor still waiting to be
    placed again is recorded as not replaced; the restarts are said and written to the
    store (`record`: events, store, run id); then every Ray actor and placement group of
    this run goes."""
    from ray.util.placement_group import remove_placement_group

    events, store, run_id = record

    with contextlib.suppress(KeyboardInterrupt):
        _stop_all(ray, actors, learner, config, echo)
    for h in actors:
        if h.placing is not None:  # placed again, and no node held it before the end
            events.append(
                event(
                    h.label,
                    h.incarnation,
                    None,
                    f"{h.placing[1]}; the run ended before a node could hold it",
                    replaced=False,
                )
            )
    with contextlib.suppress(Exception):
        echo(restarts_text(events))
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
        self.hosts: list[Held] = []
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
            self.hosts.append(Held(label, handle, rank))

    def launch(self, cause: str | None) -> None:
        ray = self.ray
        self.incarnation += 1
        if cause is not None:
            self.events.append(event("learner", self.incarnation, None, cause))
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
                event(
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
                event(
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


def _death(ray, h: Held) -> str:
    """Why a host died, as far as the driver can tell: its node lost, or the host itself."""
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    if h.node_id and h.node_id not in alive:
        return f"its node {h.node_id[:8]} was lost"
    return "its Ray actor died"


def _supervise(
    ray, actors: list[Held], learner: _Learner, config, echo, events: list[dict], new_actor_host
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
                events.append(event(h.label, h.incarnation, h.placing[2], h.placing[1]))
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
                        event(
                            h.label,
                            h.incarnation + 1,
                            None,
                            f"its process exited with {state.returncode}; no restart left",
                            replaced=False,
                        )
                    )
                continue
            echo(f"[{h.label}] (ray) exited with {state.returncode}; restarting it")
            h.incarnation, run_id = h.incarnation + 1, new_id()
            events.append(
                event(h.label, h.incarnation, run_id, f"its process exited with {state.returncode}")
            )
            h.poll = h.handle.restart.remote(h.incarnation, run_id)
        give_up_placing(ray, actors, config, echo, events)
        if actors and all(h.gone for h in actors):
            if all(h.code for h in actors):  # each said why: that is the run's line
                raise GagpoError(_actors_failed(actors))
            echo("ray: every actor is gone; the learner is stopped")
            return 1
        time.sleep(POLL_S)


def _actor_host_died(ray, h: Held, cause: str, config, echo, events, new_actor_host) -> None:
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
            event(h.label, h.incarnation + 1, None, f"{cause}; no restart left", replaced=False)
        )
        return
    h.incarnation, run_id = h.incarnation + 1, new_id()
    h.handle = new_actor_host(h, run_id)
    h.placing = (time.monotonic(), cause, run_id)
    echo(
        f"[{h.label}] (ray) {cause}; placing it again (restart {h.incarnation} of "
        f"{config.actor_restarts}; up to {config.place_timeout_s:g} s for a node with room)"
    )


def give_up_placing(ray, actors: list[Held], config, echo, events) -> None:
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
            event(
                h.label,
                h.incarnation,
                None,
                f"{h.placing[1]}; no node could hold it within {config.place_timeout_s:g} s",
                replaced=False,
            )
        )
        h.gone, h.poll, h.placing = True, None, None


def _actors_failed(actors: list[Held]) -> str:
    said: dict[str, list[str]] = {}
    for h in actors:
        said.setdefault(f"exited with {h.code}: {h.last or 'no output'}", []).append(h.label)
    why = "; ".join(f"{', '.join(who)} {what}" for what, who in said.items())
    return (
        f"every actor exited with an error (restarts included), so the learner was stopped; {why}"
    )


def _stop_all(ray, actors: list[Held], learner: _Learner, config, echo) -> None:
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

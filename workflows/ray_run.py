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

The pieces, each read on its own:

- this module: the command's entry points: the cluster (or this machine, for a local
  instance) checked against the placement before anything starts (`check_on_ray`), the dry
  run (`describe_on_ray`), and the run (`run_on_ray`), a shared store checked first;
- workflows/ray_placement.py: the two placement groups and the learner's rendezvous (pure
  data, no Ray imported);
- workflows/ray_host.py: what runs on a node: the hosts and their child processes
  (workflows/child.py), which die with their host;
- workflows/ray_supervisor.py: the driver's loop: placement, output relayed, restarts and lost
  nodes within run.actor_restarts, run.learner_restarts and run.place_timeout_s, and the
  clean-up of every Ray actor and placement group of the run;
- workflows/ray_restarts.py: the restart record, STORE/ray/restarts-<run id>.parquet, and the
  closing line read back from it.

When the run ends, or on Ctrl-C or SIGTERM, a local instance started here is shut down with
all its processes. A driver killed outright leaves nothing either: its Ray actors and
placement groups belong to its Ray job, which ends with it, and each host's process dies
with its host (or, on a local instance, with the instance, whose processes die with the driver).
"""

from __future__ import annotations

import contextlib
import os
import uuid

from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from gagpo.workflows.layout import Plan
from gagpo.workflows.ray_placement import (
    Placement,
    check_cluster,
    describe,
    describe_resources,
    place,
)
from gagpo.workflows.ray_supervisor import cluster_resources, run_placed

NAMESPACE = "gagpo"


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


def run_on_ray(
    plan: Plan, config, echo, *, address: str | None, store: Store | str, run_id: str
) -> int:
    """Run the plan's processes on Ray (`address` None: a local instance started here);
    return the learner's exit code. Everything this run started on Ray is removed before
    returning, interrupted or not; the restarts are written to the store (the command's
    opened Store, or its URL, opened here once)."""
    from gagpo.pipeline.parallel import ray_session

    store = store if isinstance(store, Store) else Store(store)
    with ray_session(address, num_cpus=local_cpus(), namespace=NAMESPACE, echo=echo):
        import ray

        check_store_shared(ray, store)
        total, nodes = cluster_resources(ray)
        placement = _place_on(plan, config, nodes)
        check_cluster(placement, total, nodes, _where(address))
        return run_placed(ray, plan, placement, config, echo, store, run_id)


def check_store_shared(ray, store: Store) -> None:
    """On a cluster of several nodes the store must be one every node reaches: an object
    store, or a local path every node sees (a shared file system, checked with a probe
    file). Anything else is refused in one line before any process starts."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2 or not store.is_local:
        return
    probe = store.path(f".ray-probe-{uuid.uuid4().hex}")
    store.commit_bytes(probe, b"gagpo")
    try:
        seen = _probe_nodes(ray, nodes, probe)
    finally:
        with contextlib.suppress(Exception):
            store.remove(probe)
    if not all(seen):
        raise GagpoError(
            f"store {store.url!r} is a local path but the Ray cluster has {len(nodes)} nodes and "
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

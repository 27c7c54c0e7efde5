"""Where `gagpo run --ray` puts the plan's processes: pure data, no Ray imported.

Two placement groups (docs/cluster.md):

- the actors': one bundle per actor, strategy SPREAD (across nodes, as far as Ray can);
- the learner's: one bundle per node its ranks use, each holding that node's ranks (a CPU and
  a whole GPU per rank): STRICT_PACK on one node (the default, DDP/FSDP2 over NVLink), or
  STRICT_SPREAD over `learner_nodes` nodes, the ranks split evenly between them. A learner
  of one rank that shares its GPU with actors asks for its memory share of a GPU instead.

Each rank is a process of its own running the learner's command line (what torchrun would
run); its rendezvous comes from Ray (`rendezvous`): rank 0's node address and a port free
there as MASTER_ADDR / MASTER_PORT, and RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, the
variables learner/dist.py reads (torch's env:// initialisation reads the rest).

`check_cluster` holds the placement against a cluster's resources (`ray.cluster_resources()`
and each node's, never the driver's own GPUs); an impossible request is one line.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gagpo.schemas.errors import GagpoError
from gagpo.workflows.layout import Plan

ACTORS_STRATEGY = "SPREAD"


@dataclass(frozen=True)
class Placement:
    """The two placement groups of a run, and which process goes in which bundle."""

    actor_bundles: list[dict[str, float]]  # bundle i holds actor i
    learner_bundles: list[dict[str, float]]  # bundle b holds ranks b·per_node … (b+1)·per_node − 1
    ranks: int
    rank_gpu: float  # GPUs each rank asks for: 1, a share, or 0 (CPU ranks)

    @property
    def learner_nodes(self) -> int:
        return len(self.learner_bundles)

    @property
    def per_node(self) -> int:
        return self.ranks // self.learner_nodes

    @property
    def learner_strategy(self) -> str:
        return "STRICT_PACK" if self.learner_nodes == 1 else "STRICT_SPREAD"

    def rank_bundle(self, rank: int) -> int:
        return rank // self.per_node

    def needs(self) -> dict[str, float]:
        total: Counter = Counter()
        for bundle in self.actor_bundles + self.learner_bundles:
            total.update(bundle)
        return dict(total)


def actor_bundles(plan: Plan) -> list[dict[str, float]]:
    """One bundle per actor: a CPU, and its GPU: a whole one, or its memory share of one it
    shares with other processes of the plan."""
    on_gpu = Counter(g for p in plan.processes for g in p.gpus)
    out = []
    for p in plan.actors:
        bundle = {"CPU": 1.0}
        if p.gpus:
            shared = on_gpu[p.gpus[0]] > 1 and p.memory_share is not None
            bundle["GPU"] = float(p.memory_share) if shared else 1.0
        out.append(bundle)
    return out


def place(plan: Plan, learner_nodes: int = 0, node_gpus: list[float] | None = None) -> Placement:
    """The placement of `plan`. `learner_nodes` 0 means: one node if one holds every rank
    (judged on `node_gpus`, each node's GPUs, when known), else the fewest nodes that do."""
    learner = plan.learner
    ranks = learner.ranks
    on_gpu = Counter(g for p in plan.processes for g in p.gpus)
    if not learner.gpus:
        rank_gpu = 0.0
    elif ranks == 1 and on_gpu[learner.gpus[0]] > 1 and learner.memory_share is not None:
        rank_gpu = float(learner.memory_share)  # colocated with actors (gpu-alfworld)
    else:
        rank_gpu = 1.0  # a rank per whole GPU: two ranks never land on one GPU
    nodes = learner_nodes or _fewest_nodes(ranks, rank_gpu, node_gpus)
    if ranks % nodes:
        raise GagpoError(
            f"run.learner_nodes = {nodes} does not divide the learner's {ranks} rank(s); "
            f"accepted: a divisor of {ranks} (each node holds as many ranks), or 0 (automatic)"
        )
    per_node = ranks // nodes
    bundle = {"CPU": float(per_node)} | ({"GPU": rank_gpu * per_node} if rank_gpu else {})
    return Placement(actor_bundles(plan), [dict(bundle) for _ in range(nodes)], ranks, rank_gpu)


def _fewest_nodes(ranks: int, rank_gpu: float, node_gpus: list[float] | None) -> int:
    if not rank_gpu or not node_gpus or ranks * rank_gpu <= max(node_gpus):
        return 1
    for nodes in range(2, ranks + 1):
        wide = sum(1 for g in node_gpus if g >= rank_gpu * (ranks // nodes))
        if ranks % nodes == 0 and wide >= nodes:
            return nodes
    return 1  # nothing fits: check_cluster says so in one line


# What to ask for less of, when the cluster lacks GPUs or CPUs (a CPU per actor and per rank).
FEWER = {
    "GPU": "fewer run.actor_gpus / run.learner_gpus",
    "CPU": "fewer actors (--actors, [run] actors) or learner ranks",
}


def check_cluster(
    placement: Placement, total: dict[str, float], nodes: list[dict], where: str = "the Ray cluster"
) -> None:
    """The placement against a cluster: `total` is `ray.cluster_resources()`, `nodes` each
    alive node's resources. One line naming what is missing and what is accepted. GPUs and
    CPUs alike: a run Ray cannot place would wait, with its placement groups pending."""
    have = f"; {where} has " + describe_resources(total, nodes)
    need = placement.needs()
    for key in ("GPU", "CPU"):
        if need.get(key, 0.0) > total.get(key, 0.0) + 1e-9:
            raise GagpoError(
                f"the run needs {need[key]:g} {key}(s) (actors: {_sum(placement.actor_bundles, key):g}, "
                f"learner: {_sum(placement.learner_bundles, key):g}){have}; accepted: "
                f"{FEWER[key]}, or a larger cluster"
            )
    per_node = placement.learner_bundles[0]
    for key in ("GPU", "CPU"):
        wide = sum(1 for n in nodes if n.get(key, 0.0) + 1e-9 >= per_node.get(key, 0.0))
        if wide < placement.learner_nodes:
            where = (
                "one node"
                if placement.learner_nodes == 1
                else (f"each of {placement.learner_nodes} nodes")
            )
            raise GagpoError(
                f"the learner's {placement.ranks} rank(s) need {per_node.get(key, 0.0):g} {key}(s) on "
                f"{where}, and {wide} node(s) have that many{have}; accepted: run.learner_nodes "
                "= a divisor of the learner's ranks that the nodes can hold, or fewer learner GPUs"
            )
    biggest = max((n.get("GPU", 0.0) for n in nodes), default=0.0)
    if any(b.get("GPU", 0.0) > biggest + 1e-9 for b in placement.actor_bundles):
        raise GagpoError(
            f"an actor needs a GPU{have}; accepted: a cluster with GPUs, or no "
            "run.actor_gpus (actors on CPU)"
        )


def _sum(bundles: list[dict[str, float]], key: str) -> float:
    return sum(b.get(key, 0.0) for b in bundles)


def describe_resources(total: dict[str, float], nodes: list[dict]) -> str:
    gpus = ", ".join(f"{n.get('GPU', 0.0):g}" for n in nodes)
    return (
        f"{total.get('CPU', 0.0):g} CPU(s) and {total.get('GPU', 0.0):g} GPU(s) over "
        f"{len(nodes)} node(s) (GPUs per node: {gpus or 'none'})"
    )


# --- the learner's rendezvous ------------------------------------------------------------------


@dataclass(frozen=True)
class RankPlace:
    """Where a rank's host landed: its node's address, and the GPU ids Ray gave it."""

    node_ip: str
    gpu_ids: tuple[str, ...] = ()


def rendezvous(places: list[RankPlace], per_node: int, port: int) -> list[dict[str, str]]:
    """Each rank's environment, in rank order (rank r sits in bundle r // per_node, one node).

    The ranks of a node all see that node's learner GPUs (CUDA_VISIBLE_DEVICES, as under
    torchrun), and LOCAL_RANK is the position of the rank's own GPU among them, so
    learner/dist.py's cuda:LOCAL_RANK is the GPU Ray gave it."""
    world = len(places)
    out = []
    for rank, here in enumerate(places):
        first = rank - rank % per_node
        node = places[first : first + per_node]
        env = {
            "MASTER_ADDR": places[0].node_ip,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank - first),
            "LOCAL_WORLD_SIZE": str(len(node)),
            "GROUP_RANK": str(rank // per_node),
        }
        visible = sorted({g for p in node for g in p.gpu_ids}, key=_gpu_order)
        if here.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
            env["LOCAL_RANK"] = str(visible.index(here.gpu_ids[0]))
        out.append(env)
    return out


def _gpu_order(gpu: str):
    return (0, int(gpu), "") if gpu.isdigit() else (1, 0, gpu)


# --- what --dry-run --ray prints -------------------------------------------------------------


def describe(plan: Plan, placement: Placement, resources: str) -> str:
    """The placement as `gagpo run --dry-run --ray` prints it."""
    lines = [
        f"ray placement: {len(plan.actors)} actor(s) and the learner ({placement.ranks} "
        f"rank(s) on {placement.learner_nodes} node(s)); against {resources}"
    ]
    lines.append(f"  placement group gagpo-RUN-actors, strategy {ACTORS_STRATEGY}:")
    for i, (p, bundle) in enumerate(zip(plan.actors, placement.actor_bundles, strict=True)):
        lines.append(f"    bundle {i}: {_bundle(bundle):<18} {p.label}")
    lines.append(f"  placement group gagpo-RUN-learner, strategy {placement.learner_strategy}:")
    for b, bundle in enumerate(placement.learner_bundles):
        ranks = range(b * placement.per_node, (b + 1) * placement.per_node)
        each = f" ({placement.rank_gpu:g} GPU each)" if placement.rank_gpu else ""
        lines.append(
            f"    bundle {b}: {_bundle(bundle):<18} learner rank(s) "
            f"{', '.join(map(str, ranks))}{each}"
        )
    if placement.ranks > 1:
        lines.append(
            f"  rendezvous: MASTER_ADDR = rank 0's node, MASTER_PORT = a port free there (chosen "
            f"at start); per rank RANK, WORLD_SIZE={placement.ranks}, LOCAL_RANK, "
            f"LOCAL_WORLD_SIZE={placement.per_node}; each rank runs:"
        )
    else:
        lines.append("  rendezvous: none (one rank); the learner runs:")
    lines.append(f"    {' '.join(plan.learner.per_rank)}")
    lines.append(
        "  actors run the commands of the plain plan (gagpo run --dry-run without --ray); "
        "Ray sets each process's CUDA_VISIBLE_DEVICES"
    )
    return "\n".join(lines)


def _bundle(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"

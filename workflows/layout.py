"""Where `gagpo run` puts its processes: the plan, as data, before anything starts.

A recipe's [run] table says how many actors there are and, on a GPU node, which GPUs
each side gets:

- `actor_gpus = [0, 1, 2, 3]`: one actor per entry, each on its GPU (one vLLM engine or
  transformers model per actor). A GPU listed twice holds two actors, each with its
  memory share (`actors.vllm.gpu_memory_utilization`, or `actor_gpu_memory`).
- `learner_gpus = [4, 5, 6, 7]`: one GPU gives one learner process; several give
  `torchrun` with that many ranks on one node, sharding as `learner.parallel` says
  (ddp or fsdp); with `--ray`, one process per rank placed by Ray instead (`rank_command`).
- A GPU in both lists is shared (colocated): the actors' shares and the learner's
  (`learner_gpu_memory`, default what the actors leave) must fit in it.

Each process sees only its GPUs (`CUDA_VISIBLE_DEVICES`), so inside it they are cuda:0…;
its memory share reaches it as `GAGPO_GPU_MEMORY_SHARE` (the learner and transformers
actors cap their CUDA allocator with it; vLLM actors get it as gpu_memory_utilization).
CPU threads are split evenly between the processes of the machine. `gagpo run --dry-run`
prints the plan and starts nothing; an impossible layout is one line (exit 2).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from gagpo.actors.config import ActorConfig
from gagpo.schemas.config import GPU_MEMORY_SHARE_ENV
from gagpo.schemas.errors import GagpoError

SEED_STRIDE = 1_000_003  # actor i plays task seeds seed + i·stride + k: no two actors share a task
FULL = 1.0 + 1e-6  # memory shares may add up to the whole GPU (rounding aside), not more
MAX_GPU_ID = 1023  # a device index; checked in a dry run too, where no GPU is counted


@dataclass(frozen=True)
class Process:
    """One process of the plan: its label, command line, devices and environment."""

    label: str  # "actor 0", "learner"
    command: list[str]
    gpus: tuple[int, ...] = ()  # physical GPU ids (CUDA_VISIBLE_DEVICES)
    memory_share: float | None = None  # of each of its GPUs
    env: dict[str, str] = field(default_factory=dict)  # what it gets beyond os.environ
    ranks: int = 1  # learner processes (torchrun's --nproc-per-node)
    rank_command: list[str] = field(default_factory=list)  # what each rank runs, under torchrun

    @property
    def per_rank(self) -> list[str]:
        """The command line one rank runs (Ray starts it per rank): the command itself
        when there is no torchrun around it."""
        return self.rank_command or self.command

    def describe(self) -> str:
        assigned = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"[{self.label}] {assigned} {shlex.join(self.command)}".replace("]  ", "] ")


@dataclass(frozen=True)
class Plan:
    processes: list[Process]

    @property
    def actors(self) -> list[Process]:
        return [p for p in self.processes if p.label.startswith("actor")]

    @property
    def learner(self) -> Process:
        return next(p for p in self.processes if p.label == "learner")

    def describe(self) -> str:
        lines = [f"plan: {len(self.actors)} actor(s) and the learner"]
        for p in self.processes:
            where = (f"GPU {','.join(map(str, p.gpus))}" if p.gpus else "CPU") + (
                f" ({p.memory_share * 100:g} % of its memory)" if p.memory_share is not None else ""
            )
            lines.append(f"  {p.label:<9} on {where}")
        lines.append("commands:")
        lines += [f"  {p.describe()}" for p in self.processes]
        return "\n".join(lines)


def plan_run(
    recipe: Path,
    store: str,
    run,  # RunConfig
    actors: ActorConfig,
    learner,  # LearnerConfig
    *,
    actor_args: list[str],
    learner_args: list[str],
    run_id: str,
    gpus_visible: int | None = None,
    cpus: int | None = None,
) -> Plan:
    """The processes `gagpo run` starts for this recipe; GagpoError for a layout that cannot
    work (checked against `gpus_visible` GPUs when it is known)."""
    n_actors = _actor_count(run)
    check_gpu_ids(run, gpus_visible)
    actor_share = _actor_share(run, actors)
    learner_share = _check_fit(run, actor_share)
    _check_learner_device(run, learner)
    ranks = max(1, len(run.learner_gpus))
    common = _thread_env(cpus, n_actors + ranks)
    launch = _Launch(sys.executable, recipe, store, common)
    processes = [
        _actor_process(launch, i, run, actors, actor_share, run_id=run_id, args=actor_args)
        for i in range(n_actors)
    ]
    processes.append(_learner_process(launch, run, learner_share, args=learner_args))
    return Plan(processes)


@dataclass(frozen=True)
class _Launch:
    """What every process of the plan shares: the Python that runs it, the recipe and the
    store it is given, and the environment of all of them (the thread counts)."""

    python: str
    recipe: Path
    store: str
    env: dict[str, str]


def _actor_count(run) -> int:
    """One actor per actor_gpus entry, else run.actors; both given must agree."""
    if run.actor_gpus and "actors" in run.model_fields_set and run.actors != len(run.actor_gpus):
        raise GagpoError(
            f"run.actors = {run.actors} but run.actor_gpus lists {len(run.actor_gpus)} GPUs; "
            "accepted: one actor_gpus entry per actor (or leave actors out)"
        )
    return len(run.actor_gpus) if run.actor_gpus else run.actors


def _check_learner_device(run, learner) -> None:
    """Several learner GPUs mean torchrun ranks on CUDA: a CPU learner cannot use them."""
    if len(run.learner_gpus) > 1 and learner.device == "cpu":
        raise GagpoError(
            f"run.learner_gpus lists {len(run.learner_gpus)} GPUs but learner.device = 'cpu'; "
            "accepted: device = 'cuda' or 'auto' with learner GPUs"
        )


def _thread_env(cpus: int | None, processes: int) -> dict[str, str]:
    """The machine's CPU threads (`cpus`, default all) split evenly between `processes`,
    at least one each, as the BLAS and OpenMP thread counts every process is given."""
    threads = str(max(1, (cpus or os.cpu_count() or 1) // processes))
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def _actor_process(
    launch: _Launch, i: int, run, actors: ActorConfig, share: float, *, run_id: str, args
) -> Process:
    """Actor i: following the store under `run_id`, its task seeds SEED_STRIDE apart from
    the other actors'; with actor_gpus, on its GPU alone with its memory share (given to
    vLLM as gpu_memory_utilization, and to the process as GPU_MEMORY_SHARE_ENV)."""
    cmd = [
        launch.python,
        "-m",
        "gagpo.actors.cli",
        "--config",
        str(launch.recipe),
        "--store",
        launch.store,
        "--follow",
        "--run-id",
        run_id,
        "--seed",
        str(actors.seed + i * SEED_STRIDE),
        *args,
    ]
    gpus: tuple[int, ...] = ()
    env = dict(launch.env)
    if run.actor_gpus:
        gpus = (run.actor_gpus[i],)
        env |= {"CUDA_VISIBLE_DEVICES": str(gpus[0]), GPU_MEMORY_SHARE_ENV: f"{share:g}"}
        cmd += ["--device", "cuda", "--set", f"vllm.gpu_memory_utilization={share:g}"]
    return Process(f"actor {i}", cmd, gpus, share if gpus else None, env)


def _learner_process(launch: _Launch, run, share: float, *, args) -> Process:
    """The learner: on CPU or its one GPU as one process, or under torchrun with one rank
    per learner GPU (`rank_command` is what each rank runs, which Ray starts per rank with
    --ray instead: ray_placement.py). Its GPUs carry its memory share."""
    cmd = [
        launch.python,
        "-m",
        "gagpo.learner.cli",
        "--config",
        str(launch.recipe),
        "--store",
        launch.store,
        *args,
    ]
    env = dict(launch.env)
    gpus = tuple(run.learner_gpus)
    if gpus:
        env |= {
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
            GPU_MEMORY_SHARE_ENV: f"{share:g}",
        }
        cmd += ["--set", "device=cuda"]
    rank_cmd: list[str] = []
    if len(gpus) > 1:
        # torchrun on one node: one rank per GPU, each on cuda:LOCAL_RANK of its list
        rank_cmd = cmd
        cmd = [
            launch.python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={len(gpus)}",
            *cmd[1:],
        ]
    return Process("learner", cmd, gpus, share if gpus else None, env, max(1, len(gpus)), rank_cmd)


def check_gpu_ids(run, gpus_visible: int | None) -> None:
    """Every GPU id is a device index, below `gpus_visible` when that is known; no
    learner GPU is listed twice (one rank per GPU)."""
    for name in ("actor_gpus", "learner_gpus"):
        ids = getattr(run, name)
        if any(i < 0 for i in ids):
            raise GagpoError(f"run.{name} = {ids} holds a negative GPU id; accepted: 0, 1, …")
        if any(i > MAX_GPU_ID for i in ids):
            raise GagpoError(
                f"run.{name} holds GPU id {max(ids)}, not a device index; "
                f"accepted: ids 0..{MAX_GPU_ID}, one per GPU of a node"
            )
        if gpus_visible is not None and ids and max(ids) >= gpus_visible:
            seen = (
                "no GPU is visible" if gpus_visible == 0 else f"{gpus_visible} GPU(s) are visible"
            )
            raise GagpoError(
                f"run.{name} names GPU {max(ids)} but {seen}; accepted: ids 0..{gpus_visible - 1}"
                if gpus_visible
                else f"run.{name} names GPU {max(ids)} but {seen}; accepted: "
                "a machine with CUDA GPUs, or leave actor_gpus and learner_gpus out"
            )
    if len(set(run.learner_gpus)) != len(run.learner_gpus):
        raise GagpoError(
            f"run.learner_gpus = {run.learner_gpus} lists a GPU twice; accepted: one rank per GPU"
        )


def _actor_share(run, actors: ActorConfig) -> float:
    """Each actor's share of its GPU's memory."""
    if run.actor_gpu_memory is not None:
        return run.actor_gpu_memory
    per_gpu = max(Counter(run.actor_gpus).values(), default=1)
    if per_gpu == 1:
        return actors.vllm.gpu_memory_utilization
    # Several actors on one GPU and no share given: split what one engine would take.
    return round(actors.vllm.gpu_memory_utilization / per_gpu, 4)


def _check_fit(run, actor_share: float) -> float:
    """Every GPU's shares add up to at most the whole GPU; the learner's share."""
    on_gpu = Counter(run.actor_gpus)
    shared = [g for g in run.learner_gpus if g in on_gpu]
    taken = max((on_gpu[g] * actor_share for g in shared), default=0.0)
    learner_share = run.learner_gpu_memory
    if learner_share is None:
        learner_share = round(1.0 - taken, 4) if shared else 1.0
    for gpu, n in sorted(on_gpu.items()):
        if gpu in run.learner_gpus and learner_share <= 0.0:
            raise GagpoError(
                f"GPU {gpu}: {n} actor(s) × {actor_share:g} of its memory leave the learner none; "
                "accepted: smaller actor shares (run.actor_gpu_memory) on a GPU the learner shares"
            )
        total = n * actor_share + (learner_share if gpu in run.learner_gpus else 0.0)
        if total > FULL:
            who = f"{n} actor(s) × {actor_share:g}" + (
                f" + the learner's {learner_share:g}" if gpu in run.learner_gpus else ""
            )
            raise GagpoError(
                f"GPU {gpu} is over-committed: {who} = {total:g} of its memory; accepted: shares "
                "that add up to at most 1 (actors.vllm.gpu_memory_utilization, run.actor_gpu_memory, "
                "run.learner_gpu_memory)"
            )
    return learner_share

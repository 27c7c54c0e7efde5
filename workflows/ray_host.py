"""What runs on a node of the cluster under `gagpo run --ray`: one Ray actor per process of
the plan, holding that process as its child (workflows/child.py).

A `ProcessHost` holds an actor process and starts it again when it ends by itself; a
`RankHost` holds one learner rank, started by the driver once every rank's place is known.
Each runs the plan's own command line with Ray's choice of GPUs (CUDA_VISIBLE_DEVICES set by
Ray: the plan's physical ids do not apply), keeps its child's lines for the driver's polls
(`poll`), and stops it on demand (`stop`). The child dies with its host, so a host killed or
lost takes its process with it. Which incarnation runs, and under which run id, the driver
decides (workflows/ray_supervisor.py): Ray restarts no host.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from dataclasses import dataclass

from gagpo.workflows.child import Child
from gagpo.workflows.layout import SEED_STRIDE, Process
from gagpo.workflows.ray_placement import RankPlace

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


def _flags(cmd: list[str]) -> str:
    shown = [f"{flag} {cmd[cmd.index(flag) + 1]}" for flag in ("--run-id", "--seed") if flag in cmd]
    return " ".join(shown + (["--resume"] if "--resume" in cmd else []))


# --- the hosts --------------------------------------------------------------------------------


@dataclass
class HostState:
    """What a host reports on each poll."""

    lines: list[str]
    returncode: int | None  # of its process; None while it runs (or before it started)
    incarnation: int
    pid: int
    node: str  # its node's address
    node_id: str  # its node's Ray id: not among the alive nodes once the node is lost


class _Host:
    """A Ray actor's child process, its lines kept for the driver's polls. Every method runs
    on the host's main thread (a plain, non-threaded Ray actor), the thread the child's death
    signal is tied to."""

    def __init__(self, cwd: str):
        import ray

        self.cwd = cwd if os.path.isdir(cwd) else None
        self.node = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self._lock = threading.Lock()
        self.lines: list[str] = []
        self.child: Child | None = None
        self.incarnation = -1

    def _spawn(self, cmd: list[str], env: dict[str, str], incarnation: int, where: str = ""):
        self.incarnation = incarnation
        self.child = Child(cmd, env, self._say, cwd=self.cwd, dies_with_parent=True)
        self._say(
            f"(ray) started pid {self.child.pid} on node {self.node}"
            + where
            + (f", restart {incarnation}: {_flags(cmd)}" if incarnation else "")
        )

    def _say(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)

    def poll(self) -> HostState:
        with self._lock:
            lines, self.lines = self.lines, []
        child = self.child
        return HostState(
            lines,
            None if child is None else child.poll(),
            self.incarnation,
            0 if child is None else child.pid,
            self.node,
            self.node_id,
        )

    def stop(self, sig: int, timeout: float) -> HostState:
        """`sig` to the process if it runs; SIGKILL after `timeout` seconds."""
        if self.child is not None:
            self.child.stop(timeout, sig)
        return self.poll()


class ProcessHost(_Host):
    """A Ray actor holding one actor process of the plan: it starts the command line of its
    `incarnation` when created, and a later incarnation when the process ended by itself
    (`restart`). The driver numbers the incarnations and chooses their run ids: Ray restarts
    no host, and a host whose node was lost is a new Ray actor, placed again by the driver."""

    def __init__(self, process: Process, cwd: str, actors: int, incarnation: int, run_id: str):
        super().__init__(cwd)
        self.process, self.actors = process, actors
        self._start(incarnation, run_id)

    def _start(self, incarnation: int, run_id: str) -> None:
        cmd = restarted_command(self.process.command, incarnation, self.actors, run_id)
        env = {k: v for k, v in self.process.env.items() if k != "CUDA_VISIBLE_DEVICES"}
        self._spawn(cmd, env, incarnation)

    def restart(self, incarnation: int, run_id: str) -> HostState:
        """Start the process again (it ended by itself), as incarnation `incarnation`."""
        self.child.relayed()
        self._start(incarnation, run_id)
        return self.poll()


class RankHost(_Host):
    """A Ray actor holding one rank of the learner. It starts nothing by itself: the driver
    reads where every rank landed (`where`), gives each its rendezvous and starts them all
    (`launch`), and again with --resume after a failure (on new hosts when a node was lost)."""

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
        where = ""
        if world > 1:
            where = f" (rank {rank}/{world}, rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']})"
        self._spawn(cmd, env, incarnation, where)
        return self.poll()

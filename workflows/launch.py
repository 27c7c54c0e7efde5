"""How `gagpo run` starts a plan's processes: one contract, two launchers.

A launcher owns the processes of a plan (workflows/layout.py) from their start to their end:

- `check(plan)` refuses, in one line, a placement that cannot work, before anything
  starts (the warm start included);
- `describe(plan)` is the dry run's text;
- `run(plan)` starts every process, supervises them, stops them all on the way out
  (done, failed or interrupted) and returns the learner's exit code; when every actor
  has failed it raises GagpoError with their last lines (the learner would otherwise wait
  for data that never comes);
- `after()` gives the lines that close the run, after its summary.

`LocalLauncher` starts the processes on this machine, as children of this one
(workflows/child.py), and relays their output with a label. `RayLauncher` places the same
processes on a Ray cluster (workflows/ray_run.py; its supervisor, with restarts and lost
nodes, is workflows/ray_supervisor.py).
"""

from __future__ import annotations

import functools
import signal
import subprocess
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gagpo.schemas.errors import GagpoError
from gagpo.workflows import ray_run
from gagpo.workflows.child import Child, stop_all
from gagpo.workflows.layout import Plan, check_gpu_ids
from gagpo.workflows.ray_restarts import restarts_line

if TYPE_CHECKING:
    from gagpo.storage.store import Store

WATCH_S = 1.0  # seconds between two checks of the actors while the learner runs

# `config` below is a recipe's [run] table: workflows/recipe.py's RunConfig (not imported
# here, since run.py imports this module).


@runtime_checkable
class Launcher(Protocol):
    def check(self, plan: Plan) -> None:
        """GagpoError for a placement that cannot work; starts nothing."""

    def describe(self, plan: Plan) -> str:
        """The dry run's text: where each process would go. A placement the run would
        refuse is shown first, then refused (GagpoError)."""

    def run(self, plan: Plan) -> int:
        """Start, supervise and stop every process of `plan`; the learner's exit code."""

    def after(self) -> list[str]:
        """The lines that close the run, after its summary."""


def launcher_for(ray: str | None, config, store: Store | str, run_id: str, echo) -> Launcher:
    """The launcher of `gagpo run --ray`: None runs here; 'local' starts a Ray instance for
    the run; 'auto' or HOST:PORT joins a running cluster. `store`: the command's opened
    Store, or its URL (opened once, when the launcher first needs it)."""
    if ray is None:
        return LocalLauncher(config, echo)
    address = None if ray == "local" else ray
    return RayLauncher(config, echo, store=store, run_id=run_id, address=address)


# --- on this machine ----------------------------------------------------------------------


class LocalLauncher:
    """The plan's processes as children of this one, on this machine's CPUs and GPUs."""

    def __init__(self, config, echo):
        self.config = config
        self.echo = echo

    def check(self, plan: Plan) -> None:
        # The plan's GPU ids against this machine's GPUs (a dry run shows a GPU node's plan
        # anywhere, so only here).
        check_gpu_ids(self.config, gpus_visible(self.config))

    def describe(self, plan: Plan) -> str:
        return plan.describe()

    def run(self, plan: Plan) -> int:
        actor_procs: list[Child] = []
        learner: Child | None = None
        try:
            for p in plan.actors:
                actor_procs.append(Child(p.command, p.env, self.echo, label=p.label))
            pids = ", ".join(str(p.pid) for p in actor_procs)
            self.echo(f"{len(actor_procs)} actor(s) started (pids {pids})")
            p = plan.learner
            learner = Child(p.command, p.env, self.echo, label=p.label)
            self.echo(f"learner started (pid {learner.pid})")
            while True:
                try:
                    return learner.wait(timeout=WATCH_S)
                except subprocess.TimeoutExpired:
                    pass
                # Without an actor the learner waits for data (or for v0) that never comes.
                if actor_procs and all(proc.poll() for proc in actor_procs):
                    raise GagpoError(actors_failed(actor_procs, [a.label for a in plan.actors]))
        finally:
            # Interrupted or done: the learner finishes (SIGINT: it stops between updates,
            # nothing torn), then the actors commit their groups and exit (SIGTERM).
            if learner is not None:
                stop_all([learner], self.config.stop_timeout_s, signal.SIGINT)
            stop_all(actor_procs, self.config.stop_timeout_s, signal.SIGTERM)

    def after(self) -> list[str]:
        return []


def gpus_visible(config) -> int | None:
    """GPUs this machine has, when the recipe places processes on GPUs (else unchecked)."""
    if not (config.actor_gpus or config.learner_gpus):
        return None
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def actors_failed(procs: list[Child], labels: list[str]) -> str:
    """One line for a run whose actors have all exited with an error: each distinct last
    line they printed (their own one-line error), with the actors that printed it."""
    said: dict[str, list[str]] = {}
    for proc, label in zip(procs, labels, strict=True):
        proc.relayed()  # the last lines reach the console first
        said.setdefault(
            f"exited with {proc.returncode}: {proc.last_line or 'no output'}", []
        ).append(label)
    why = "; ".join(f"{', '.join(who)} {what}" for what, who in said.items())
    return f"every actor exited with an error, so the learner was stopped; {why}"


# --- on Ray ---------------------------------------------------------------------------------


class RayLauncher:
    """The plan's processes placed by Ray (`address` None: a local instance started for the
    run); the supervisor, its restarts and its clean-up are workflows/ray_run.py's."""

    def __init__(self, config, echo, *, store: Store | str, run_id: str, address: str | None):
        self.config = config
        self.echo = echo
        self.store = store
        self.run_id = run_id
        self.address = address

    @functools.cached_property
    def opened(self) -> Store:
        """The store, opened once: not before the run needs it (a dry run never does)."""
        from gagpo.storage.store import Store

        return self.store if isinstance(self.store, Store) else Store(self.store)

    def check(self, plan: Plan) -> None:
        # Against the cluster's resources (or, for a local instance, this machine's),
        # never the GPUs this driver sees.
        ray_run.check_on_ray(plan, self.config, self.address)

    def describe(self, plan: Plan) -> str:
        # A placement the cluster cannot hold is still shown, then refused in one line
        # ("cannot be placed: …"), as the run would refuse it.
        lines: list[str] = []
        try:
            ray_run.describe_on_ray(plan, self.config, self.address, lines.append)
        except GagpoError:
            self.echo("\n".join(lines))
            raise
        return "\n".join(lines)

    def run(self, plan: Plan) -> int:
        return ray_run.run_on_ray(
            plan,
            self.config,
            self.echo,
            address=self.address,
            store=self.opened,
            run_id=self.run_id,
        )

    def after(self) -> list[str]:
        return [restarts_line(self.opened, self.run_id)]  # as recorded in the store

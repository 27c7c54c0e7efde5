"""`gagpo run`: actors and the learner together, from a recipe (workflows/run.py)."""

from __future__ import annotations

import sys

import click

from gagpo.schemas.cli import ray_option, set_option, store_option
from gagpo.workflows.recipes import shipped as shipped_recipes


@click.command(name="run", context_settings={"help_option_names": ["-h", "--help"]})
@store_option("store", help="Store root (local path or fsspec URL) shared by actors and learner.")
@click.option(
    "--recipe",
    default="demo",
    show_default=True,
    help="A recipe TOML file ([run], [actors], [learner] tables) or a shipped recipe: "
    + ", ".join(shipped_recipes())
    + ".",
)
@click.option("--actors", type=int, help="Actor processes (overrides the recipe's [run] actors).")
@set_option(
    "learner.loss.eps_low=0.1",
    "actors.sampling.top_p=0.9",
    "learner.log_to=['tensorboard']",
    tables=("run", "actors", "learner"),
    over="the recipe",
)
@click.option(
    "--warmstart/--no-warmstart",
    "warm",
    default=True,
    show_default=True,
    help="Build (or reuse from the cache) the recipe's [warmstart] policy first and start from it.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (each process, its GPUs and memory share, its command line and "
    "CUDA_VISIBLE_DEVICES) and start nothing.",
)
@ray_option(
    "Place the processes with Ray (pip install 'gagpo[ray]'; docs/cluster.md): 'auto' or "
    "HOST:PORT joins a running cluster, --ray alone starts a local instance for the run."
)
def run_command(
    store: str,
    recipe: str,
    actors: int | None,
    sets: tuple[str, ...],
    warm: bool,
    dry_run: bool,
    ray_address: str | None,
) -> None:
    """Run actors and the learner together on this machine, talking only through the store.

    A recipe's [warmstart] table runs first (cached under $GAGPO_CACHE/warmstart/) and its
    policy becomes version 0. The actors roll out with --follow and pick up each version
    the learner publishes; when the learner has made its updates the actors finish their
    group and stop; success rate, valid replies and return per policy version are printed,
    and a report (plots, summary.md) is written into STORE/report/.

    On a GPU node, [run] actor_gpus and learner_gpus place each process on its GPUs
    (several learner GPUs: torchrun); --dry-run shows where everything would go.
    """
    from gagpo.workflows.run import run

    code = run(
        recipe,
        store,
        actors=actors,
        echo=click.echo,
        sets=sets,
        warm=warm,
        dry_run=dry_run,
        ray=ray_address,
    )
    if code:
        sys.exit(code)  # click's Exit would be swallowed under standalone_mode=False

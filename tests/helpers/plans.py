"""A run's plan from a recipe and `--set`-style overrides, on a machine of a given size."""

from __future__ import annotations

from gagpo.actors.config import ActorConfig
from gagpo.learner.config import LearnerConfig
from gagpo.schemas.config import load_config
from gagpo.schemas.overrides import parse_sets
from gagpo.workflows.layout import plan_run
from gagpo.workflows.run import RunConfig, recipe_path


def plan_for(recipe: str, *sets: str, gpus_visible: int | None = 8, cpus: int = 64):
    path = recipe_path(recipe)
    by_table: dict[str, list[str]] = {"run": [], "actors": [], "learner": []}
    for item in sets:
        table, rest = item.split(".", 1)
        by_table[table].append(rest)
    run = load_config(
        RunConfig, path, section="run", overrides=parse_sets(by_table["run"], RunConfig)
    )
    actors = load_config(
        ActorConfig,
        path,
        section="actors",
        overrides=parse_sets(by_table["actors"], ActorConfig) | {"store": "S"},
    )
    learner = load_config(
        LearnerConfig,
        path,
        section="learner",
        overrides=parse_sets(by_table["learner"], LearnerConfig) | {"store": "S"},
    )
    return plan_run(
        path,
        "S",
        run,
        actors,
        learner,
        actor_args=[],
        learner_args=[],
        run_id="R",
        gpus_visible=gpus_visible,
        cpus=cpus,
    )

"""The umbrella `gagpo` CLI: one entry point for every stage.

Subcommands are imported lazily so that `gagpo --help` stays instant (no torch,
no Polars imported to print help), and each subcommand pays only its own imports
(`gagpo sql` loads no config model, so no pydantic).
"""

from __future__ import annotations

import importlib

import click

from gagpo.schemas.cli import run_cli

# name -> (module, attribute, one-line summary)
SUBCOMMANDS = {
    "run": (
        "gagpo.workflows.run_cli",
        "run_command",
        "Run actors and learner together from a recipe.",
    ),
    "warmstart": (
        "gagpo.workflows.warmstart_cli",
        "warmstart_command",
        "Demonstrations + supervised fine-tuning → a cached base policy.",
    ),
    "actors": ("gagpo.actors.cli", "actors_command", "Roll out a policy and write grouped shards."),
    "advantages": ("gagpo.pipeline.cli", "advantages", "Compute advantages from stored steps."),
    "learner": (
        "gagpo.learner.cli",
        "learner_command",
        "Train on shards and publish policy versions.",
    ),
    "compact": (
        "gagpo.learner.compact",
        "compact_command",
        "Move consumed shards from the inbox into archive segments.",
    ),
    "sql": ("gagpo.inspection.cli", "sql_command", "Query a store with read-only SQL."),
    "report": ("gagpo.inspection.cli", "report_command", "Plots and a summary of a store."),
    "view": ("gagpo.workflows.view", "view_command", "A local read-only web app over a store."),
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module only when it runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module, attr, _ = SUBCOMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, SUBCOMMANDS[name][2]) for name in sorted(SUBCOMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gagpo", prog_name="gagpo", message="%(prog)s %(version)s")
def gagpo() -> None:
    """GAGPO: grouped multi-turn rollouts, a Polars advantage stage and an asynchronous learner."""


def main() -> None:
    run_cli(gagpo, prog_name="gagpo")


if __name__ == "__main__":
    main()

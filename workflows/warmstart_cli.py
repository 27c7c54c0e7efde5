"""`gagpo warmstart`: its options are generated from `WarmstartConfig` (schemas/cli_models.py),
in a module of its own so that they are built only when the command runs, not for every
`gagpo` subcommand."""

from __future__ import annotations

import click

from gagpo.schemas.cli import config_option, set_option
from gagpo.schemas.cli_models import ModelOptions
from gagpo.workflows.warmstart import WarmstartConfig

OPTIONS = ModelOptions(WarmstartConfig)


@click.command(
    name="warmstart",
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
@OPTIONS
@config_option("warmstart")
@set_option("noise=0.2", "env_options.size=6")
def warmstart_command(config_file, sets, **values) -> None:
    """Warm-start POLICY on ENV: expert demonstrations written as ordinary grouped shards,
    supervised fine-tuning on them (gagpo-learner --mode sft), the result cached.

    Prints the warm-started policy folder (a Hugging Face folder: pass it as --policy to
    gagpo-actors, gagpo-learner, or a recipe). A second call with the same settings reuses
    $GAGPO_CACHE/warmstart/<key>/ at once. Own demonstration data: docs/warmstart.md.
    """
    from gagpo.workflows.warmstart import warmstart

    cfg = OPTIONS.load(config_file, sets, values, section="warmstart")
    folder = warmstart(cfg, echo=lambda line: click.echo(line, err=True))
    click.echo(str(folder))

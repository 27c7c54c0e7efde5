"""`gagpo warmstart`: its own module, so that its options' help (read from the warm-start
config model) is built only when the command runs, not for every `gagpo` subcommand."""

from __future__ import annotations

import click


def _warm_help(name: str) -> str:
    from gagpo.schemas.cli import field_help
    from gagpo.workflows.warmstart import WarmstartConfig

    return field_help(WarmstartConfig, name)


@click.command(name="warmstart", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--env", help=_warm_help("env"))
@click.option("--policy", help=_warm_help("policy"))
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML file: its [warmstart] table (or the top level); flags override it.",
)
@click.option("--demos", type=int, help=_warm_help("demos"))
@click.option("--noise", type=float, help=_warm_help("noise"))
@click.option("--max-turns", type=int, help=_warm_help("max_turns"))
@click.option("--history-window", type=int, help=_warm_help("history_window"))
@click.option("--batch-groups", type=int, help=_warm_help("batch_groups"))
@click.option("--lr", type=float, help=_warm_help("lr"))
@click.option("--seed", type=int, help=_warm_help("seed"))
@click.option("--eval-groups", type=int, help=_warm_help("eval_groups"))
def warmstart_command(config_file, **flags) -> None:
    """Warm-start POLICY on ENV: expert demonstrations written as ordinary grouped shards,
    supervised fine-tuning on them (gagpo-learner --mode sft), the result cached.

    Prints the warm-started policy folder (a Hugging Face folder: pass it as --policy to
    gagpo-actors, gagpo-learner, or a recipe). A second call with the same settings reuses
    $GAGPO_CACHE/warmstart/<key>/ at once. Own demonstration data: docs/warmstart.md.
    """
    from gagpo.schemas.config import load_config
    from gagpo.workflows.warmstart import WarmstartConfig, warmstart

    cfg = load_config(WarmstartConfig, config_file, section="warmstart", overrides=flags)
    folder = warmstart(cfg, echo=lambda line: click.echo(line, err=True))
    click.echo(str(folder))

"""`gagpo-learner`: the asynchronous learner (its training loop lands with issue #4).

Until then the command documents its interface with `--help` and says plainly that
training is not available yet, rather than pretending to train.
"""

from __future__ import annotations

import click

from gagpo.schemas.errors import GagpoError
from gagpo.workflows.clitools import run_cli


@click.command(name="learner", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--store", help="Store root (local path or fsspec URL) the actors write into.")
@click.option(
    "--policy",
    help="Base policy: a preset name (tiny, smollm2-135m) or a Hugging Face model folder.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML file ([learner] table); flags override it.",
)
@click.option("--updates", type=int, help="Number of policy updates to run.")
@click.option("--batch-groups", type=int, help="B: groups per update batch.")
@click.option(
    "--max-staleness", type=int, help="Drop (and count) data more than this many versions behind."
)
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint in STORE/learner/.")
def learner_command(**_: object) -> None:
    """Consume committed shards, train with the GAGPO objective and publish policy versions.

    Not available yet: this release ships the actors, the store and the advantage
    stage; the learner arrives with the next one.
    """
    raise GagpoError(
        "the learner is not available in this release yet; run gagpo-actors and gagpo advantages"
    )


def main() -> None:
    run_cli(learner_command, prog_name="gagpo-learner")


if __name__ == "__main__":
    main()

"""`gagpo-learner`: train on committed shards with the GAGPO objective, publish policy versions.

Parses and validates first; torch and transformers are imported only after that, so
`--help` and configuration errors are instant.
"""

from __future__ import annotations

import os
import sys

import click

from gagpo.learner.config import LearnerConfig
from gagpo.schemas.cli import config_option, run_cli, set_option
from gagpo.schemas.cli_models import ModelOptions

EXIT_STOPPED_EARLY = 3  # the data ran out (idle-timeout, replay read) before `updates`


# Flags users know under other names than the fields' (the fields' own names work too).
ALIASES = {
    "--bypass": "loss.bypass",
    "--behavior-cap": "loss.behavior_cap",
    "--kl-coef": "loss.kl_coef",
    "--eps-low": "loss.eps_low",
    "--eps-high": "loss.eps_high",
    "--entropy-coef": "loss.entropy_coef",
    "--lora": "lora.enabled",
    "--poll-interval": "poll_interval_s",
    "--idle-timeout": "idle_timeout_s",
    "--as-of-update": "replay_as_of_update",
}
OPTIONS = ModelOptions(
    LearnerConfig, aliases=ALIASES, metavars={"replay": "STORE", "replay_as_of_update": "U"}
)


@click.command(
    name="learner", context_settings={"help_option_names": ["-h", "--help"], "show_default": True}
)
@OPTIONS
@config_option("learner")
@set_option("loss.eps_low=0.1", "lora.rank=16")
@click.option("--quiet", is_flag=True, help="No progress lines; only the summary.")
def learner_command(config_file, sets, quiet, **values) -> None:
    """Consume committed shards, train with the GAGPO objective and publish policy versions.

    Each update takes B whole groups from STORE/shards/ (oldest first, each group once,
    recorded in STORE/learner/ledger.parquet), computes their advantages, makes the
    optimiser step(s) and publishes the next version to STORE/policy/v<N>/, then points
    STORE/policy/LATEST at it. Metrics go to STORE/learner/metrics/ and histograms.zarr.
    Stopping before --updates (idle timeout, replay data read) prints why and exits 3.
    Several processes: torchrun --nproc-per-node N -m gagpo.learner.cli ... [--parallel fsdp]
    """
    config = OPTIONS.load(config_file, sets, values, section="learner")

    from gagpo.schemas.extras import require

    require("learner", "gagpo-learner")
    from gagpo.learner.sinks import check_trackers

    check_trackers(config.log_to)  # a missing tracker package: one line, before the model loads
    from gagpo.learner.preflight import check_start

    check_start(config)  # fail at once rather than wait for what will never come
    from gagpo.learner.train import train  # heavy: torch, transformers

    summary = train(config, echo=None if quiet else _echo)
    main_rank = os.environ.get("RANK", "0") == "0"
    if main_rank:  # under torchrun, one summary
        click.echo(
            f"learner: {summary.updates} update(s) done, policy v{summary.version} published; "
            f"{summary.groups} group(s) trained in this run, {summary.stale_groups} dropped as "
            f"stale, {summary.rejected_shards} shard(s) rejected"
        )
    code = 0
    if summary.stopped is not None:  # fewer updates than asked: say why, exit non-zero
        if main_rank:
            click.echo(
                f"gagpo-learner: stopped after {summary.updates} of {config.updates} updates: "
                f"{summary.stopped}",
                err=True,
            )
        code = EXIT_STOPPED_EARLY
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Everything is committed and the process group destroyed. Skip the interpreter's
        # teardown, where C++ static destructors run: once, in CI under load, a rank
        # aborted there ("terminate called without an active exception") after its work.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


def _echo(line: str) -> None:
    click.echo(line, err=True)


def main() -> None:
    run_cli(learner_command, prog_name="gagpo-learner")


if __name__ == "__main__":
    main()

"""`gagpo-learner`: train on committed shards with the GAGPO objective, publish policy versions.

Parses and validates first; torch and transformers are imported only after that, so
`--help` and configuration errors are instant.
"""

from __future__ import annotations

import os
import sys

import click

from gagpo.learner.config import LearnerConfig, LoraSettings, LossSettings
from gagpo.pipeline.config import ESTIMATOR_NAMES
from gagpo.schemas.cli import field_choices, field_help, run_cli, set_option
from gagpo.schemas.overrides import merge, parse_sets

L = LearnerConfig
EXIT_STOPPED_EARLY = 3  # the data ran out (idle-timeout, replay read) before `updates`


@click.command(
    name="learner", context_settings={"help_option_names": ["-h", "--help"], "show_default": True}
)
@click.option("--store", help=field_help(L, "store"))
@click.option("--policy", help=field_help(L, "policy"))
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML file with these settings (its [learner] table, or the top level); flags override it.",
)
@click.option("--mode", type=field_choices(L, "mode"), help=field_help(L, "mode"))
@click.option("--updates", type=int, help=field_help(L, "updates"))
@click.option("--batch-groups", type=int, help=field_help(L, "batch_groups"))
@click.option("--max-staleness", type=int, help=field_help(L, "max_staleness"))
@click.option("--mini-batches", type=int, help=field_help(L, "mini_batches"))
@click.option("--micro-batch-tokens", type=int, help=field_help(L, "micro_batch_tokens"))
@click.option("--lr", type=float, help=field_help(L, "lr"))
@click.option("--warmup-steps", type=int, help=field_help(L, "warmup_steps"))
@click.option(
    "--lr-schedule", type=field_choices(L, "lr_schedule"), help=field_help(L, "lr_schedule")
)
@click.option("--lr-final", type=float, help=field_help(L, "lr_final"))
@click.option("--weight-decay", type=float, help=field_help(L, "weight_decay"))
@click.option("--grad-clip", type=float, help=field_help(L, "grad_clip"))
@click.option("--temperature", type=float, help=field_help(L, "temperature"))
@click.option(
    "--estimator",
    help="Advantage estimator (parameters in the config's [learner.estimator] table). "
    f"Accepted: {', '.join(ESTIMATOR_NAMES)}. [default: gagpo]",
)
@click.option("--bypass/--no-bypass", default=None, help=field_help(LossSettings, "bypass"))
@click.option("--behavior-cap", type=float, help=field_help(LossSettings, "behavior_cap"))
@click.option("--kl-coef", type=float, help=field_help(LossSettings, "kl_coef"))
@click.option("--eps-low", type=float, help=field_help(LossSettings, "eps_low"))
@click.option("--eps-high", type=float, help=field_help(LossSettings, "eps_high"))
@click.option("--entropy-coef", type=float, help=field_help(LossSettings, "entropy_coef"))
@click.option("--keep-versions", type=int, help=field_help(L, "keep_versions"))
@click.option("--keep-every", type=int, help=field_help(L, "keep_every"))
@click.option("--device", help=field_help(L, "device"))
@click.option("--parallel", type=field_choices(L, "parallel"), help=field_help(L, "parallel"))
@click.option("--seed", type=int, help=field_help(L, "seed"))
@click.option(
    "--poll-interval", "poll_interval_s", type=float, help=field_help(L, "poll_interval_s")
)
@click.option("--idle-timeout", "idle_timeout_s", type=float, help=field_help(L, "idle_timeout_s"))
@click.option("--replay", metavar="STORE", help=field_help(L, "replay"))
@click.option("--as-of-update", "replay_as_of_update", type=int, metavar="U",
              help=field_help(L, "replay_as_of_update"))  # fmt: skip
@click.option("--resume", is_flag=True, default=None, help=field_help(L, "resume"))
@click.option("--lora", is_flag=True, default=None, help=field_help(LoraSettings, "enabled"))
@click.option("--lora-rank", type=int, help=field_help(LoraSettings, "rank"))
@click.option("--lora-alpha", type=float, help=field_help(LoraSettings, "alpha"))
@click.option("--lora-dropout", type=float, help=field_help(LoraSettings, "dropout"))
@click.option(
    "--lora-target-modules",
    metavar="NAMES",
    help=field_help(LoraSettings, "target_modules") + " Comma-separated, e.g. q_proj,v_proj.",
)
@click.option("--precision", type=field_choices(L, "precision"), help=field_help(L, "precision"))
@click.option(
    "--log-to",
    metavar="LIST",
    help="Trackers that also get the metrics, comma-separated: tensorboard, wandb, mlflow "
    "(same metric names; the store's learner/metrics/ stays the record).",
)
@click.option("--log-dir", help=field_help(L, "log_dir"))
@set_option("loss.eps_low=0.1", "lora.rank=16")
@click.option("--quiet", is_flag=True, help="No progress lines; only the summary.")
def learner_command(
    config_file, quiet, estimator, bypass, behavior_cap, kl_coef, lora, sets, **flags
) -> None:
    """Consume committed shards, train with the GAGPO objective and publish policy versions.

    Each update takes B whole groups from STORE/shards/ (oldest first, each group once,
    recorded in STORE/learner/ledger.parquet), computes their advantages, makes the
    optimiser step(s) and publishes the next version to STORE/policy/v<N>/, then points
    STORE/policy/LATEST at it. Metrics go to STORE/learner/metrics/ and histograms.zarr.
    Stopping before --updates (idle timeout, replay data read) prints why and exits 3.
    Several processes: torchrun --nproc-per-node N -m gagpo.learner.cli ... [--parallel fsdp]
    """
    from gagpo.schemas.config import load_config

    overrides = dict(flags)
    overrides |= {"loss.bypass": bypass, "loss.behavior_cap": behavior_cap, "loss.kl_coef": kl_coef}
    overrides |= {f"loss.{k}": overrides.pop(k) for k in ("eps_low", "eps_high", "entropy_coef")}
    overrides |= {
        "lora.rank": overrides.pop("lora_rank"),
        "lora.alpha": overrides.pop("lora_alpha"),
    }
    overrides |= {"lora.dropout": overrides.pop("lora_dropout")}
    if (targets := overrides.pop("lora_target_modules")) is not None:
        overrides["lora.target_modules"] = [t.strip() for t in targets.split(",") if t.strip()]
    overrides |= {"estimator.estimator": estimator, "lora.enabled": lora}
    if overrides["log_to"] is not None:
        overrides["log_to"] = [
            name.strip() for name in overrides["log_to"].split(",") if name.strip()
        ]
    overrides = merge(parse_sets(sets, LearnerConfig, "learner"), overrides)
    config = load_config(LearnerConfig, config_file, section="learner", overrides=overrides)

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

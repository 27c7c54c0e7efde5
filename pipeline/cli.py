"""`gagpo advantages`: recompute advantages for Parquet files or for the shards of a store.

The command parses and validates its options, then calls a plain function of
`gagpo.pipeline.recompute`; Polars is imported only after parsing, so `--help` is instant.
User errors raise GagpoError, which the CLI runner prints as one line (exit code 2).
"""

from __future__ import annotations

import contextlib
from typing import Any

import click

from gagpo.pipeline.config import (
    ESTIMATOR_NAMES,
    GIGPO_VARIANTS,
    AdvantagesCommand,
    EstimatorConfig,
    GagpoConfig,
    GigpoConfig,
    parse_estimator_config,
)
from gagpo.schemas.cli import field_help, ray_option, run_cli, set_option
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.overrides import merge, parse_sets

GAGPO_FAMILY = ("gagpo", "gagpo_lambda0", "gagpo_lambda1")


def estimator_config(settings: dict[str, Any], omega: str | None) -> Any:
    """The estimator config from TOML settings and flags; --omega is ω_E for the GAGPO
    family and ω for GiGPO."""
    settings = dict(settings)
    name = settings.get("estimator") or "gagpo"
    if omega is not None:
        if name in GAGPO_FAMILY:
            settings["omega_episode"] = omega
        elif name == "gigpo":
            settings["omega"] = omega
        else:
            raise GagpoError(
                f"--omega does not apply to estimator {name}; accepted: gagpo, gagpo_lambda0, "
                "gagpo_lambda1 (episode weight ω_E) and gigpo (step weight ω)"
            )
    return parse_estimator_config(settings)


@click.command(name="advantages", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--input",
    "inputs",
    multiple=True,
    metavar="FILE_OR_GLOB",
    help="Parquet file(s) of steps with at least group_id, traj_id, step, state_key, "
    "next_state_key, reward, done, truncated; repeatable. Each file is one batch.",
)
@click.option("--out", metavar="FILE", help=field_help(AdvantagesCommand, "out"))
@click.option("--store", metavar="URL", help=field_help(AdvantagesCommand, "store"))
@click.option("--run", "run_id", metavar="ID", help=field_help(AdvantagesCommand, "run"))
@click.option(
    "--estimator",
    metavar="NAME",
    help=f"Advantage estimator; accepted: {', '.join(ESTIMATOR_NAMES)} [default: gagpo]",
)
@click.option("--gamma", metavar="FLOAT", help=field_help(GagpoConfig, "gamma"))
@click.option("--lam", metavar="FLOAT", help=field_help(GagpoConfig, "lam") + " (gagpo only)")
@click.option("--norm", metavar="MODE", help=field_help(GagpoConfig, "norm"))
@click.option(
    "--omega",
    metavar="FLOAT",
    help="Weight of the extra term: ω_E of the episode advantage for gagpo* "
    f"[default: {GagpoConfig.model_fields['omega_episode'].default}], ω of the step "
    f"advantage for gigpo [default: {GigpoConfig.model_fields['omega'].default}].",
)
@click.option("--eps", metavar="FLOAT", help=field_help(GagpoConfig, "eps"))
@click.option(
    "--step-std/--no-step-std",
    default=None,
    help=field_help(GigpoConfig, "step_std") + " (gigpo only)",
)
@click.option(
    "--gigpo-variant",
    "variant",
    metavar="NAME",
    help=field_help(GigpoConfig, "variant")
    + f" Accepted: {', '.join(GIGPO_VARIANTS)} (gigpo only).",
)
@click.option(
    "--state-grouping",
    "state_grouping",
    metavar="MODE",
    help="Which steps share a value-proxy pool; accepted: exact [default], normalized, "
    "normalized:MODULE:FUNCTION, similar:TAU, minhash:TAU (docs/design.md §4).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML file: its [advantages] table (or the top level) sets estimator fields and "
    "input/out/store/run/compression; flags override it.",
)
@click.option("--compression", metavar="CODEC", help=field_help(AdvantagesCommand, "compression"))
@click.option("--as-of-update", "as_of_update", type=click.IntRange(min=0), metavar="U",
              help=field_help(AdvantagesCommand, "as_of_update"))  # fmt: skip
@set_option("lam=0.9", "norm=batch")
@click.option("--quiet", is_flag=True, help="Print only the summary line, not the diagnostics.")
@click.option(
    "--workers",
    type=click.IntRange(1, 1024),
    default=1,
    show_default=True,
    help="With --store: shards recomputed in parallel, at most this many at a time (memory "
    "is bounded by that many shards); the output is the serial run's, byte for byte.",
)
@ray_option(
    "With --workers: run the workers as Ray tasks (pip install 'gagpo[ray]'): 'auto' "
    "or HOST:PORT joins a running cluster, --ray alone starts a local instance. Default: "
    "processes on this machine."
)
def advantages(
    inputs, out, store, run_id, omega, config_file, compression, as_of_update, quiet, sets,
    workers, ray_address, **flags
) -> None:  # fmt: skip
    """Compute GAGPO (or baseline) advantages for stored steps.

    \b
    gagpo advantages --input 'steps/*.parquet' --out adv.parquet --estimator gagpo --lam 0.9
    gagpo advantages --store s3://bucket/store --run r1 --estimator gigpo

    With --input, every file is processed on its own (a group must sit whole in one
    file) and the tables are written together to --out, estimator name and parameters
    in the file metadata. With --store, each committed shard gets its table under
    advantages/<estimator_tag>/<shard_id>.parquet. Diagnostics are printed per batch
    and summarised over groups.
    """
    from gagpo.schemas.config import load_config

    command = {"input": list(inputs) or None, "out": out, "store": store, "run": run_id,
               "compression": compression, "as_of_update": as_of_update}  # fmt: skip
    overrides = merge(parse_sets(sets, EstimatorConfig, "advantages"), flags | command)
    cmd = load_config(AdvantagesCommand, config_file, section="advantages", overrides=overrides)
    inputs, out, store, run_id, compression = (
        cmd.input,
        cmd.out,
        cmd.store,
        cmd.run,
        cmd.compression,
    )
    as_of_update = cmd.as_of_update
    settings = cmd.estimator_settings()
    config = estimator_config(settings, omega)

    if store and (inputs or out):
        raise GagpoError("give either --store or --input/--out, not both")
    from gagpo.pipeline.memory import reuse_freed_memory

    reuse_freed_memory()
    if store:
        from gagpo.pipeline.recompute import recompute_store

        with _shard_progress(quiet) as progress:
            summary = recompute_store(
                store, run_id, config, progress=progress, workers=workers,
                backend="ray" if ray_address else None,
                ray_address=None if ray_address == "local" else ray_address,
                as_of_update=as_of_update,
            )  # fmt: skip
        for path, reason in summary.quarantined:
            click.echo(f"quarantined {path}: {reason}", err=True)
        click.echo(
            f"wrote {summary.shards} shard table(s)"
            + (f" ({summary.segments} of them archive segments)" if summary.segments else "")
            + f", {summary.diagnostics.batch['steps']} steps, under {store.rstrip('/')}/advantages/"
            f"{config.tag}{'' if as_of_update is None else f'@u{as_of_update}'}/"
        )
        if not quiet:
            click.echo(summary.diagnostics.format())
        return
    if run_id:
        raise GagpoError("--run applies only with --store")
    if as_of_update is not None:
        raise GagpoError("--as-of-update applies only with --store")
    if workers > 1 or ray_address:
        raise GagpoError("--workers and --ray apply only with --store")
    if not inputs or not out:
        raise GagpoError(
            "missing --input/--out or --store; accepted: --input FILE_OR_GLOB --out FILE, "
            "or --store URL [--run ID]"
        )
    from gagpo.pipeline.recompute import recompute_files

    diag = recompute_files(inputs, out, config, compression)
    click.echo(f"wrote {diag.batch['steps']} steps to {out} ({config.tag})")
    if not quiet:
        click.echo(diag.format())


@contextlib.contextmanager
def _shard_progress(quiet: bool):
    """A bar with shards done/total, elapsed time and the time left (on a terminal;
    nothing otherwise, and nothing with --quiet)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    bar = Progress(
        TextColumn("[bold]shards"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True,
        disable=quiet or not console.is_terminal,
    )  # fmt: skip
    task = bar.add_task("shards", total=None)

    def progress(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    with bar:
        yield progress


def main() -> None:
    """`python -m gagpo.pipeline.cli`: the command alone, user errors as one line, exit 2."""
    run_cli(advantages, prog_name="gagpo advantages")


if __name__ == "__main__":
    main()

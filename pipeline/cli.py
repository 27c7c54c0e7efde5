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
    AdvantagesCommand,
    EstimatorConfig,
    GagpoConfig,
    GigpoConfig,
    parse_estimator_config,
)
from gagpo.schemas import layout
from gagpo.schemas.cli import config_option, ray_option, run_cli, set_option
from gagpo.schemas.cli_models import ModelOptions
from gagpo.schemas.errors import GagpoError

GAGPO_FAMILY = ("gagpo", "gagpo_lambda0", "gagpo_lambda1")


def estimator_config(settings: dict[str, Any], omega: str | float | None) -> Any:
    """The estimator config from TOML settings and flags; --omega is ω_E for the GAGPO
    family and ω for GiGPO."""
    settings = dict(settings)
    name = settings.get("estimator") or "gagpo"
    if omega is not None:
        try:
            omega = float(omega)
        except ValueError:
            raise GagpoError(f"--omega {omega!r} is not a number; accepted: e.g. 0.5") from None
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


# The command's fields and every estimator's, at the top level as in its TOML table.
# --omega is written below: it means ω_E for the GAGPO family and ω for GiGPO.
OPTIONS = ModelOptions(
    AdvantagesCommand,
    EstimatorConfig,
    aliases={"--gigpo-variant": "variant"},
    metavars={
        "input": "FILE_OR_GLOB",
        "out": "FILE",
        "store": "URL",
        "run": "ID",
        "as_of_update": "U",
        "compression": "CODEC",
    },
    skip=("omega",),
    whole=("input",),
)


@click.command(name="advantages", context_settings={"help_option_names": ["-h", "--help"]})
@OPTIONS
@click.option(
    "--omega",
    metavar="FLOAT",
    help=f"With estimator gigpo, {GigpoConfig.model_fields['omega'].description} With gagpo, "
    "gagpo_lambda0 or gagpo_lambda1, ω_E: the weight of the episode advantage, as "
    "--omega-episode. [default: "
    f"{GigpoConfig.model_fields['omega'].default} (gigpo), "
    f"{GagpoConfig.model_fields['omega_episode'].default} (gagpo*)]",
)
@config_option("advantages")
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
def advantages(omega, config_file, sets, quiet, workers, ray_address, **values) -> None:
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
    cmd = OPTIONS.load(config_file, sets, values, section="advantages")
    inputs, out, store, run_id = cmd.input, cmd.out, cmd.store, cmd.run
    compression, as_of_update = cmd.compression, cmd.as_of_update
    config = estimator_config(cmd.estimator_settings(), omega)

    if store and (inputs or out):
        raise GagpoError("give either --store or --input/--out, not both")
    from gagpo.pipeline.memory import reuse_freed_memory

    reuse_freed_memory()
    if store:
        from gagpo.pipeline.recompute import recompute_store

        with _shard_progress(quiet) as progress:
            summary = recompute_store(
                store,
                run_id,
                config,
                progress=progress,
                workers=workers,
                backend="ray" if ray_address else None,
                ray_address=None if ray_address == "local" else ray_address,
                as_of_update=as_of_update,
            )
        for path, reason in summary.quarantined:
            click.echo(f"quarantined {path}: {reason}", err=True)
        click.echo(
            f"wrote {summary.shards} shard table(s)"
            + (f" ({summary.segments} of them archive segments)" if summary.segments else "")
            + f", {summary.diagnostics.batch['steps']} steps, under {layout.advantages_dir(store.rstrip('/'))}/"
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
        TextColumn("[bold]shards"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    )
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

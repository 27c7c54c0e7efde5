"""`gagpo-actors`: roll out a policy in an environment and write grouped shards to a store."""

from __future__ import annotations

import click

from gagpo.actors.config import ActorConfig
from gagpo.envs import environment_names
from gagpo.schemas import layout
from gagpo.schemas.cli import config_option, run_cli, set_option
from gagpo.schemas.cli_models import ModelOptions

# Built-ins and entry points of installed packages; the registry imports no engine: cheap.
ENV_NAMES = ", ".join(environment_names())


def _progress_printer(total: int | None):
    """A rich progress bar with groups, steps/s and success rate (plain lines when not a TTY)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]groups"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TextColumn("{task.fields[clock]}"),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )
    task = progress.add_task("groups", total=total, stats="", clock="loading the policy")

    def update(summary) -> None:
        # Called for lost groups too: until a group is written no version has played one.
        version = f"v{max(summary.versions)}" if summary.versions else "-"
        stats = (
            f"{summary.steps} steps  {summary.steps_per_second:.1f} steps/s  "
            f"success {summary.success_rate:.0%}  policy {version}  "
            f"throttled {summary.seconds_throttled:.0f}s"
        )
        lost = getattr(summary, "groups_lost", 0)
        if lost:
            stats += f"  lost {lost}"
        loads = getattr(summary, "loads", [])
        if loads:  # the newest version's cost: fetched while generating, then the pause
            last = loads[-1]
            stats += f"  v{last.version} fetch {last.fetch_s:.1f}s pause {last.pause_s:.1f}s"
        # The actor's own clock: it starts once the policy is loaded, not at the command.
        clock = f"{_duration(summary.seconds_total)} elapsed"
        if total and summary.groups:
            left = summary.seconds_total / summary.groups * max(total - summary.groups, 0)
            clock += f", ETA {_duration(left)}"
        progress.update(task, completed=summary.groups, stats=stats, clock=clock)
        if not console.is_terminal:
            console.print(
                f"groups {summary.groups}{'/' + str(total) if total else ''}  {stats}  {clock}",
                soft_wrap=True,  # one line per group in logs, whatever their width
            )

    return progress, update


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return (
        f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"
        if minutes >= 60
        else f"{minutes}:{secs:02d}"
    )


def _print_summary(summary, store_url: str) -> None:
    total = summary.seconds_total or 1e-9
    click.echo(
        f"run {summary.run_id}: {summary.groups} groups, {summary.rollouts} rollouts, "
        f"{summary.steps} steps in {summary.seconds_total:.1f}s ({summary.steps_per_second:.1f} steps/s, "
        f"{summary.tokens / total:.0f} reply tokens/s); "
        f"success rate {summary.success_rate:.1%}; policy versions "
        f"{', '.join(str(v) for v in sorted(summary.versions)) or '-'}; "
        f"{summary.groups_in_flight} group(s) in flight"
        + (
            f"; {summary.groups_lost} group(s) lost (environment errors)"
            if summary.groups_lost
            else ""
        )
        # Later steps whose prompt does not extend the previous step's (schemas/extends.py).
        + f"; prompt drift {summary.prompt_drift}/{max(summary.steps - summary.rollouts, 0)}"
        + f" (window slides {summary.window_slides})"
    )
    click.echo(
        f"time: generate {summary.seconds_generate / total:.0%}, environment "
        f"{summary.seconds_env / total:.0%}, writing shards {summary.seconds_write / total:.1%}, "
        f"throttled (waiting for the learner's backlog) {summary.seconds_throttled:.1f}s"
    )
    if summary.loads:
        click.echo(_loads_line(summary.loads))
    click.echo(
        f"{len(summary.shards)} shard(s) written under {layout.run_dir(store_url.rstrip('/'), summary.run_id)}/"
    )


def _loads_line(loads) -> str:
    """Per version loaded: its download (overlapped with generation) and the engine's pause
    (drain and load, no reply started), e.g. `v3 fetch 1.2s pause 0.4s`."""
    each = ", ".join(f"v{x.version} fetch {x.fetch_s:.1f}s pause {x.pause_s:.2f}s" for x in loads)
    return f"versions loaded (fetched while generating; engine paused to drain and load): {each}"


# Flags users know under other names than the fields' (the fields' own names work too).
ALIASES = {
    "--temperature": "sampling.temperature",
    "--top-p": "sampling.top_p",
    "--max-new-tokens": "sampling.max_new_tokens",
    "--batch-size": "sampling.batch_size",
    "--vllm-lora": "vllm.enable_lora",
    "--vllm-gpu-memory": "vllm.gpu_memory_utilization",
    "--store-retry-seconds": "store_retry_s",
}
OPTIONS = ModelOptions(ActorConfig, aliases=ALIASES, extra_help={"env": f"Accepted: {ENV_NAMES}."})


@click.command(
    name="actors", context_settings={"help_option_names": ["-h", "--help"], "show_default": True}
)
@OPTIONS
@config_option("actors")
@set_option("sampling.top_p=0.9", "env_options.challenge=tw-cooking")
@click.option("--quiet", is_flag=True, help="No progress output; only the summary.")
def actors_command(config_file, sets, quiet, **values) -> None:
    """Roll out POLICY in ENV, G rollouts per task, and commit whole groups as Parquet shards.

    Before each group the newest complete policy version named by STORE/policy/LATEST
    is loaded (none yet: the base policy is version 0). Any number of actor processes
    may write into one store at once; give each its own --seed for distinct tasks.
    With --follow an actor also waits while the learner's backlog (committed groups not
    in STORE/learner/ledger.parquet) covers what it can train within max_staleness.
    """
    config = OPTIONS.load(config_file, sets, values, section="actors")

    from gagpo.schemas.extras import require

    require("actors", "gagpo-actors")
    from gagpo.actors.actor import run_actor

    progress, update = (
        (None, None) if quiet else _progress_printer(None if config.follow else config.groups)
    )
    if progress is not None:
        with progress:
            summary = run_actor(config, progress=update)
    else:
        summary = run_actor(config)
    _print_summary(summary, config.store)


def main() -> None:
    run_cli(actors_command, prog_name="gagpo-actors")


if __name__ == "__main__":
    main()

"""Shared CLI plumbing for every layer: help text from config docstrings and one-line user errors
(the options generated from a whole config model are in schemas/cli_models.py)."""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING

import click

from gagpo.schemas.errors import GagpoError, describe, first_line, is_disk_full, is_transient
from gagpo.schemas.signals import SIGINT_FROM_PARENT, take_sigint_back

if TYPE_CHECKING:  # pydantic is imported by the commands that load a config model
    from pydantic import BaseModel


def field_help(model: type[BaseModel], name: str) -> str:
    """A config field's docstring and default, for click's --help."""
    info = model.model_fields[name]
    text = " ".join((info.description or "").split())
    if not info.is_required() and info.default_factory is None:
        text += f" [default: {info.default}]"
    return text


def config_option(table: str):
    """`--config FILE`: the command's settings from a TOML file (its `table`, or the top
    level), under `--set` and the flags; the path arrives as `config_file`."""
    return click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False),
        help=f"TOML file with these settings (its [{table}] table, or the top level); --set "
        "and the flags override it.",
    )


STORE_HELP = "Store root: a local path or an fsspec URL (file://…, s3://…)."
STORES_HELP = (
    "Store root (local path or fsspec URL); repeat to compare runs on shared axes, each "
    "optionally labelled (--store gagpo=runs/a --store grpo=runs/b). Default label: the "
    "store folder's name."
)


def store_option(dest: str = "store_url", *, many: bool = False, help: str | None = None):
    """`--store`, required: one store root (`URL`, arriving as `dest`), or with `many` a
    repeatable `[LABEL=]URL` (reports and views that compare runs); `help` replaces the
    usual text where a command says more (gagpo run: the store both sides share)."""
    return click.option(
        "--store",
        dest,
        required=True,
        multiple=many,
        metavar="[LABEL=]URL" if many else "URL",
        help=help or (STORES_HELP if many else STORE_HELP),
    )


def ray_option(help: str):
    """`--ray [ADDRESS]`: 'auto' or HOST:PORT joins a running Ray cluster, `--ray` alone
    means a local instance ("local"); the value arrives as `ray_address` (None: no Ray)."""
    return click.option(
        "--ray",
        "ray_address",
        is_flag=False,
        flag_value="local",
        default=None,
        metavar="[ADDRESS]",
        help=help,
    )


def run_cli(command: click.Command, prog_name: str) -> None:
    """Run a click command: user errors become one line on stderr and exit code 2."""
    try:
        if (
            os.environ.get(SIGINT_FROM_PARENT)
            and threading.current_thread() is threading.main_thread()
        ):
            take_sigint_back()  # a Ctrl-C held while we started is raised here: "interrupted"
        command.main(prog_name=prog_name, standalone_mode=False)
    except GagpoError as exc:
        click.echo(f"{prog_name}: error: {exc}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo(f"{prog_name}: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo(f"{prog_name}: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # outside the store's own calls: still one line
        if is_disk_full(exc):  # e.g. a local temporary folder (a model saved before upload)
            where = f" writing {exc.filename}" if getattr(exc, "filename", None) else ""
            click.echo(
                f"{prog_name}: error: no space left on the device{where} ({first_line(exc)}); "
                "accepted: a disk with free space",
                err=True,
            )
            sys.exit(2)
        if not is_transient(exc):
            raise
        click.echo(
            f"{prog_name}: error: the store did not answer ({describe(exc)}); accepted: a "
            "reachable store",
            err=True,
        )
        sys.exit(2)


def set_option(*examples: str, tables: tuple[str, ...] = (), over: str = "--config"):
    """The repeatable `--set KEY=VALUE` option (dotted overrides, schemas/overrides.py),
    its help showing `examples` of the command's own keys; values arrive as `sets`. With
    `tables` (gagpo run: run, actors, learner) a KEY starts with one of them; `over` is
    what the values override (a recipe, for gagpo run)."""
    from gagpo.schemas.overrides import set_help

    metavar = "TABLE.KEY=VALUE" if tables else "KEY=VALUE"
    return click.option(
        "--set",
        "sets",
        multiple=True,
        metavar=metavar,
        help=set_help(*examples, tables=tables, over=over),
    )


class OneLineCommand(click.Command):
    """A click command whose bad option value is one line and exit code 2 (a GagpoError,
    as `run_cli` prints it), as a config model's fields give it, not click's usage block."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.BadParameter as exc:
            message = exc.format_message().rstrip(".")
            raise GagpoError(f"{message[:1].lower()}{message[1:]}; see --help") from None

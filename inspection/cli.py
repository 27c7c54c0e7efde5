"""`gagpo sql` and `gagpo report`: inspect a store with read-only SQL, plots and a summary.

DuckDB and matplotlib are imported inside the commands so that `--help` is instant.
"""

from __future__ import annotations

import contextlib
import sys

import click

from gagpo.inspection.arguments import (
    DEFAULT_GAMMA,
    DEFAULT_TIMEOUT_S,
    check_store_root,
    timeout_problem,
)
from gagpo.schemas.cli import OneLineCommand, store_option
from gagpo.schemas.errors import GagpoError

FORMATS = ("table", "csv", "json", "parquet")
_PROMPT, _CONTINUE = "gagpo> ", "  ...> "
_HELP = """\
Enter SQL ending with ';'. Meta commands:
  .views   the views and their columns
  .help    this text
  .quit    leave (also .exit or end of input)"""


class _Seconds(click.ParamType):
    """A query time limit in seconds, as inspection/arguments.py bounds it."""

    name = "seconds"

    def convert(self, value, param, ctx) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        problem = timeout_problem(seconds)
        if problem is not None:
            self.fail(f"{value!r} {problem}", param, ctx)
        return seconds


def gamma_option(func):
    """--gamma: the discount of the views' return-to-go (inspection/sql.py `open_store_db`)."""
    return click.option(
        "--gamma",
        type=click.FloatRange(0.0, 1.0),
        default=DEFAULT_GAMMA,
        show_default=True,
        help="Discount for step_returns and for value proxies of groups without stored advantages.",
    )(func)


def limit_options(func):
    """--timeout and --memory-limit: the bounds of every query (inspection/sql.py `Limits`)."""
    func = click.option(
        "--memory-limit",
        metavar="SIZE",
        default="",
        help="DuckDB memory limit (and the largest result) per query, e.g. 2GB; spills go to a "
        "private temporary folder. [default: half the machine's memory, at most 4 GiB]",
    )(func)
    return click.option(
        "--timeout",
        "timeout_s",
        type=_Seconds(),
        default=DEFAULT_TIMEOUT_S,
        show_default=True,
        metavar="SECONDS",
        help="Stop a query that runs longer than this (0: no limit).",
    )(func)


class _SqlCommand(OneLineCommand):
    """`gagpo sql`: a QUERY that starts with a SQL comment (`-- …`) is the query, not an
    option (an option's name has no space or line break)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        queries = [a for a in args if _is_commented_query(a)]
        if queries:  # after "--" click takes them as arguments, whatever they start with
            args = [a for a in args if not _is_commented_query(a)] + ["--", *queries]
        return super().parse_args(ctx, args)


def _is_commented_query(arg: str) -> bool:
    name = arg.split("=", 1)[0]
    return arg.startswith("--") and any(c.isspace() for c in name)


@click.command("sql", cls=_SqlCommand, context_settings={"help_option_names": ["-h", "--help"]})
@store_option()
@click.argument("query", required=False)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="table",
    show_default=True,
    help="Output format; parquet needs --out.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write the result to this file instead of standard output.",
)
@click.option(
    "--max-rows",
    type=click.IntRange(min=1),
    default=200,
    show_default=True,
    help="Rows shown by --format table (csv, json and parquet write all rows).",
)
@click.option(
    "--as-of-update",
    "as_of_update",
    type=click.IntRange(min=0),
    metavar="U",
    help="Views of the store as it stood after learner update U: the groups its ledger "
    "records up to U, learner metrics and policy versions up to U.",
)
@gamma_option
@limit_options
def sql_command(
    store_url: str,
    query: str | None,
    fmt: str,
    out: str | None,
    max_rows: int,
    as_of_update: int | None,
    gamma: float,
    timeout_s: float,
    memory_limit: str,
) -> None:
    """Query a store with read-only DuckDB SQL.

    Views: steps, advantages, estimators, step_returns, trajectories, groups,
    state_pools, policy_versions, learner_metrics, learner_histograms (see
    docs/inspect.md). Without QUERY, opens an interactive prompt. Queries cannot
    write files or read outside the store, and each is bounded by --timeout and
    --memory-limit.
    """
    if query is not None and not query.strip().strip(";").strip():
        raise GagpoError(
            'the query is empty; accepted: SQL such as "SELECT count(*) FROM steps", or no '
            "QUERY for the interactive prompt"
        )
    if fmt == "parquet" and out is None:
        raise GagpoError("--format parquet needs --out FILE; accepted: --out result.parquet")
    if out is not None:
        _check_out(out)
    check_store_root(store_url)
    from gagpo.inspection.sql import Limits, close_store_db, open_store_db, query_store

    limits = Limits(timeout_s=timeout_s, memory_limit=memory_limit)
    if query is not None:
        result = query_store(
            store_url, query, gamma=gamma, limits=limits, as_of_update=as_of_update
        )
        _emit(result, fmt, out, max_rows)
        return
    con = open_store_db(store_url, gamma=gamma, limits=limits, as_of_update=as_of_update)
    try:
        _interactive(con, max_rows, limits)
    finally:
        close_store_db(con)


@click.command(
    "report", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]}
)
@store_option("store_urls", many=True)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default="gagpo-report",
    show_default=True,
    help="Folder for the PNG plots and summary.md (created if missing).",
)
@click.option(
    "--traj",
    "traj_ids",
    multiple=True,
    metavar="TRAJ_ID",
    help="Trajectory for the credit heatmap (repeatable); default: the best and worst "
    "rollout of the group whose returns differ most.",
)
@gamma_option
@limit_options
def report_command(
    store_urls: tuple[str, ...],
    out: str,
    traj_ids: tuple[str, ...],
    gamma: float,
    timeout_s: float,
    memory_limit: str,
) -> None:
    """Write PNG plots and a Markdown summary of one store or several runs compared:
    learning curves, episodes, advantage distributions and credit by turn, value proxy
    against return, singleton states, credit heatmaps and learner diagnostics."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from gagpo.inspection.report import PARTS, parse_store_spec, write_report
    from gagpo.inspection.sql import Limits

    for spec in store_urls:  # before any figure is drawn: nothing written for a wrong store
        _check_store_holds_data(parse_store_spec(spec)[1])

    console = Console(stderr=True)
    columns = (
        TextColumn("[bold]report"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    )
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as bar:
        task = bar.add_task("opening stores", total=len(store_urls) + PARTS)

        def progress(done: str) -> None:
            bar.update(task, advance=1, description=done)
            if not console.is_terminal:
                console.print(f"report: {done}")

        report = write_report(
            list(store_urls),
            out,
            traj_ids=list(traj_ids),
            gamma=gamma,
            progress=progress,
            limits=Limits(timeout_s=timeout_s, memory_limit=memory_limit),
        )
    click.echo(f"wrote {report.summary}")
    for path in report.figures:
        click.echo(f"wrote {path}")


def _check_store_holds_data(url: str) -> None:
    """A report of a folder that does not exist, or holds none of a store's folders, would
    be empty figures: one line instead."""
    from gagpo.schemas import layout
    from gagpo.schemas.layout import LEARNER, POLICY, SHARDS
    from gagpo.storage.store import Store

    check_store_root(url)
    store = Store(url)
    if not store.exists(store.root):
        raise GagpoError(f"store {url!r} does not exist; accepted: an existing store root")
    if not any(store.exists(folder) for folder in layout.data_folders(store.root)):
        raise GagpoError(
            f"store {url!r} holds no GAGPO data (no {SHARDS}/, {POLICY}/ or {LEARNER}/); "
            "accepted: a store written by gagpo-actors or gagpo-learner"
        )


# --- output --------------------------------------------------------------------------
def _check_out(out: str) -> None:
    """Fail before the query when --out cannot be written."""
    import os

    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise GagpoError(f"--out {out!r} is a directory; accepted: a file path")
    if not os.path.isdir(parent):
        raise GagpoError(
            f"--out {out!r}: folder {parent!r} does not exist; accepted: a file in an existing folder"
        )
    if not os.access(parent, os.W_OK):
        raise GagpoError(
            f"--out {out!r}: folder {parent!r} is not writable; accepted: a writable folder"
        )


def _emit(table, fmt: str, out: str | None, max_rows: int) -> None:
    try:
        _write(table, fmt, out, max_rows)
    except OSError as exc:  # the file system refused after all (full disk, /proc, …)
        raise GagpoError(f"--out {out!r} cannot be written ({exc.strerror or exc})") from None


def _write(table, fmt: str, out: str | None, max_rows: int) -> None:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, out)
        return
    if fmt == "table":
        text = _render_table(table, max_rows)
    elif fmt == "csv":
        text = render_csv(table)
    else:
        text = _render_json(table)
    if out is None:
        click.echo(text, nl=not text.endswith("\n"))
    else:
        with open(out, "w", encoding="utf-8") as handle:
            handle.write(text)


def _render_table(table, max_rows: int) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    view = Table(show_edge=False, header_style="bold")
    for field in table.schema:
        numeric = str(field.type).startswith(("int", "uint", "float", "double", "decimal"))
        view.add_column(field.name, justify="right" if numeric else "left", overflow="fold")
    for row in table.slice(0, max_rows).to_pylist():
        view.add_row(*(_cell(value) for value in row.values()))
    console = Console(width=200, file=io.StringIO(), color_system=None)
    console.print(view)
    shown = min(max_rows, table.num_rows)
    note = f"({table.num_rows} row{'s' if table.num_rows != 1 else ''}"
    note += f", first {shown} shown; --format csv writes all)" if shown < table.num_rows else ")"
    return console.file.getvalue() + note + "\n"


def _cell(value) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "…"


def render_csv(table) -> str:
    """`table` as `gagpo sql --format csv` writes it (also `gagpo view`'s CSV download)."""
    import io

    import pyarrow as pa
    import pyarrow.csv as pacsv

    # CSV has no nested types: lists are written as JSON text.
    columns = [
        _json_column(column) if pa.types.is_nested(column.type) else column
        for column in table.columns
    ]
    buffer = io.BytesIO()
    pacsv.write_csv(pa.table(columns, names=table.column_names), buffer)
    return buffer.getvalue().decode("utf-8")


def _json_column(column):
    import json

    import pyarrow as pa

    return pa.array([None if v is None else json.dumps(v) for v in column.to_pylist()], pa.string())


def _render_json(table) -> str:
    """A JSON array of row objects; NaN and infinities become null."""
    import json
    import math

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return value

    rows = [clean(row) for row in table.to_pylist()]
    return json.dumps(rows, default=str, indent=None) + "\n"


# --- interactive prompt --------------------------------------------------------------
def _interactive(con, max_rows: int, limits=None) -> None:
    from gagpo.inspection.sql import describe_views, run_query

    tty = sys.stdin.isatty()
    if tty:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing; no history file is written)
        click.echo("gagpo sql: read-only views over the store. .help for help, .quit to leave.")
    buffer: list[str] = []
    while True:
        try:
            line = input((_CONTINUE if buffer else _PROMPT) if tty else "")
        except EOFError:
            break
        command = line.strip()
        if not buffer and command.startswith("."):
            if command in (".quit", ".exit"):
                break
            if command == ".views":
                click.echo(describe_views(con))
            elif command == ".help":
                click.echo(_HELP)
            else:
                click.echo(f"unknown command {command!r}; accepted: .views .help .quit", err=True)
            continue
        if not command and not buffer:
            continue
        buffer.append(line)
        if command.endswith(";"):
            query, buffer = "\n".join(buffer), []
            try:
                click.echo(_render_table(run_query(con, query, limits), max_rows), nl=False)
            except GagpoError as exc:
                click.echo(f"error: {exc}", err=True)
    if buffer:
        click.echo("error: input ended inside a statement (missing ';'); not run", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def inspect() -> None:
    """Inspect a GAGPO store: read-only SQL and reports."""


inspect.add_command(sql_command)
inspect.add_command(report_command)


def main() -> None:
    from gagpo.schemas.cli import run_cli

    run_cli(inspect, prog_name="gagpo")


if __name__ == "__main__":
    main()

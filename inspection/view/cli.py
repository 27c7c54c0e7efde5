"""`gagpo view`: the command (`view_command`, its options written here once), and what it
does once parsed: check the bind and the stores, then serve the app with uvicorn.

workflows/view.py builds the command with the environments' step oracle (this layer may
not import the environments). Starlette and uvicorn (the `view` extra) are imported only
when it runs, so `gagpo --help` stays instant and a missing extra is one line.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from gagpo.inspection.cli import gamma_option, limit_options
from gagpo.schemas.cli import OneLineCommand
from gagpo.schemas.errors import GagpoError

if TYPE_CHECKING:
    from gagpo.inspection.view.data import StepOracle


def sessions(specs: tuple[str, ...], gamma: float, limits) -> list:
    """One StoreSession per `--store [LABEL=]URL`, labelled as `gagpo report` labels runs."""
    from gagpo.inspection.report import parse_store_spec, run_names
    from gagpo.inspection.view.data import StoreSession

    parsed = [parse_store_spec(spec) for spec in specs]
    names = run_names(parsed)
    return [
        StoreSession(name, url, limits=limits, gamma=gamma)
        for name, (_, url) in zip(names, parsed, strict=True)
    ]


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise GagpoError(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}); accepted: "
                "a free --port, an address of this machine as --host"
            ) from None


def serve(
    store_specs: tuple[str, ...],
    host: str,
    port: int,
    token: str | None,
    gamma: float,
    timeout_s: float,
    memory_limit: str,
    oracle: StepOracle | None = None,
) -> None:
    """What `gagpo view` does once parsed (workflows/view.py, which passes the environments'
    step `oracle`): check the bind and the stores, print the URL, serve until stopped."""
    from gagpo.schemas.extras import require

    require("view", "gagpo view")
    import uvicorn

    from gagpo.inspection.sql import Limits
    from gagpo.inspection.view.access import is_loopback
    from gagpo.inspection.view.app import create_app

    limits = Limits(timeout_s=timeout_s, memory_limit=memory_limit)
    stores = sessions(store_specs, gamma, limits)
    for store in stores:  # a wrong store is one line now, not an error page later
        store.query("SELECT 1")
    generated = token is None and not is_loopback(host)
    if generated:
        token = secrets.token_urlsafe(24)
    app = create_app(stores, host=host, token=token, sql_limits=limits, oracle=oracle)
    check_port_free(host, port)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    click.echo(f"gagpo view: serving {', '.join(s.label for s in stores)} at {url}")
    if generated:
        click.echo(
            "gagpo view: the access token above was generated for this run (--token sets one)"
        )
    if is_loopback(host):
        click.echo(
            f"gagpo view: from another machine: ssh -N -L {port}:127.0.0.1:{port} "
            "USER@THIS-HOST, then open the URL there"
        )
    try:
        uvicorn.run(
            app, host=host, port=port, log_level="warning", server_header=False, access_log=False
        )
    finally:
        for store in stores:
            store.close()


def view_command(oracle: Callable[[], StepOracle | None] = lambda: None) -> click.Command:
    """The `gagpo view` command; `oracle()` gives the step oracle of the compare page,
    called once the options are parsed (workflows/view.py: the environments')."""

    @click.command(
        "view", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]}
    )
    @click.option(
        "--store",
        "store_specs",
        required=True,
        multiple=True,
        metavar="[LABEL=]URL",
        help="Store root (local path or fsspec URL); repeat to show several runs on shared "
        "axes (--store gagpo=runs/a --store grpo=runs/b).",
    )
    @click.option(
        "--host",
        default="127.0.0.1",
        show_default=True,
        help="Address to listen on. Any address but loopback needs an access token.",
    )
    @click.option("--port", type=click.IntRange(1, 65535), default=8765, show_default=True)
    @click.option(
        "--token",
        default=None,
        metavar="TOKEN",
        help="Access token every request must carry (?token=… once, then a cookie). "
        "Generated and printed when --host is not loopback and none is given.",
    )
    @gamma_option
    @limit_options
    def view(**options) -> None:
        """Serve a local, read-only web app over the store: the run's learning curves, each
        group's rollouts side by side with their credit under any estimator, state pools,
        and the SQL sandbox of `gagpo sql` (docs/inspect.md)."""
        serve(**options, oracle=oracle())

    return view

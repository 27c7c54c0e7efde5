"""`gagpo view`: the command, and the step oracles of the environments it is given.

The app (inspection/view/) may not import the environments (actors/), so this module wires
them in: on the compare page, where a group's environment declares a step oracle
(Sokoban's solver), it says which moves were optimal and each estimator's credit AUC is computed as `make demo`'s credit table does
(workflows/credit.py's `label` and `credit_auc`, for one group or one rollout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gagpo.inspection.cli import gamma_option, limit_options
from gagpo.schemas import columns as C
from gagpo.schemas.cli import OneLineCommand

if TYPE_CHECKING:  # Polars and the solver load when a page asks, not for `gagpo --help`
    import polars as pl


class EnvironmentOracle:
    """The step oracle an environment declares (envs/base.py, StepOracle; Sokoban's
    exact solver) as the view's `StepOracle` (inspection/view/data.py): a group of an
    environment that declares none gets no labels."""

    name = "the environment's step oracle"

    def label(self, steps: pl.DataFrame) -> pl.DataFrame | None:
        envs = steps[C.ENV].unique().to_list() if steps.height else []
        if len(envs) != 1:
            return None
        from gagpo.envs import step_oracle

        oracle = step_oracle(envs[0])
        if oracle is None:
            return None
        from gagpo.workflows import credit

        return credit.label(steps, oracle)

    def score(self, scored: pl.DataFrame) -> dict[str, float]:
        from gagpo.workflows import credit

        return credit.credit_auc(scored)


@click.command("view", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
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
def view_command(
    store_specs: tuple[str, ...],
    host: str,
    port: int,
    token: str | None,
    gamma: float,
    timeout_s: float,
    memory_limit: str,
) -> None:
    """Serve a local, read-only web app over the store: the run's learning curves, each
    group's rollouts side by side with their credit under any estimator, state pools,
    and the SQL sandbox of `gagpo sql` (docs/inspect.md)."""
    from gagpo.inspection.view.cli import serve

    serve(
        store_specs, host, port, token, gamma, timeout_s, memory_limit, oracle=EnvironmentOracle()
    )

"""`gagpo view`: the command, and the step oracles of the environments it is given.

The app (inspection/view/) may not import the environments (envs/), so this module wires
them in: on the compare page, where a group's environment declares a step oracle
(Sokoban's solver), it says which moves were optimal, and each estimator's credit AUC is
computed as `make demo`'s credit table does (workflows/credit.py's `label` and
`credit_auc`, for one group or one rollout). The command's options are
inspection/view/cli.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gagpo.inspection.view import cli as view_cli
from gagpo.schemas import columns as C

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


view_command = view_cli.view_command(oracle=EnvironmentOracle)

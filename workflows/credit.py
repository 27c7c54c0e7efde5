"""Credit assignment on a run's own store: what each estimator makes of the same steps.

The run's stored steps are recomputed (the advantage stage, `gagpo advantages --store`; no
training) under GRPO, GiGPO, GAGPO λ = 0 and GAGPO with the run's λ, each committed under
STORE/advantages/<tag>/ so that SQL sees them. For each estimator, over every step:
- zero advantage: the share of steps whose advantage is 0 (|A| < ZERO): no credit at all;
  GRPO gives 0 to every step of a group whose rollouts all scored the same;
- advantage IQR: the spread of the advantages (numpy's / DuckDB's linear quantiles);
- credit AUC: the probability that a move the environment's step oracle calls optimal (it
  starts a shortest solution from its state: Sokoban's exact solver, the environment
  class's `optimal_moves`, envs/base.py `StepOracle`) has a higher advantage than one it does
  not (ties ½; 0.5 = no credit, 1 = perfect ranking). Steps in solved or unsolvable states
  carry no label and are left out of the AUC only;
- credit AUC within a state: the same, over the pairs of moves made from one state of one
  group only (the comparison a state's policy gradient makes: which move from here was
  better). The pooled AUC also ranks moves of different states against each other, so an
  estimator whose advantages carry a state's later TD residuals (GAE, λ > 0) loses there
  what it gains here; GRPO, one advantage per rollout, ranks moves well across states and
  poorly within one.

`credit_figure` draws one trajectory's advantages under each estimator, turn by turn, with
the optimal moves marked; SQL_QUERY recomputes the first two columns from the views.
benchmarks/learning/credit.py compares stores of the learning benchmark with the same oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from gagpo.envs import step_oracle
from gagpo.envs.base import StepOracle
from gagpo.pipeline.config import EstimatorConfig, parse_estimator_config
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store

ZERO = 1e-6  # |advantage| below this counts as zero (the stage's normalisation ε)
FIGURE = "credit.png"  # written beside the report's figures
STEP_COLUMNS = (*C.ADVANTAGE_INPUT_COLUMNS, C.ACTION_TEXT, C.POLICY_VERSION, C.ENV)

SQL_QUERY = (
    "SELECT estimator, count(*) AS steps, "
    f"avg((abs(advantage) < {ZERO})::INT) AS zero_share, "
    "quantile_cont(advantage, 0.75) - quantile_cont(advantage, 0.25) AS iqr "
    "FROM advantages GROUP BY estimator ORDER BY estimator"
)


# --- the oracle: an environment's optimal moves (envs/base.py, StepOracle) ----------


def oracle_of(env: str) -> type[StepOracle]:
    """Environment `env`'s step oracle, or a one-line error: the comparison needs one."""
    oracle = step_oracle(env)
    if oracle is None:
        raise GagpoError(
            f"environment {env!r} declares no step oracle; accepted: an "
            "environment whose class has optimal_moves and parse_move (sokoban)"
        )
    return oracle


def steps_env(steps: pl.DataFrame) -> str:
    """The one environment of `steps` (their `env` column), or a one-line error."""
    envs = steps[C.ENV].unique().to_list() if C.ENV in steps.columns else []
    if len(envs) != 1:
        what = (
            f"steps of several environments ({', '.join(map(str, envs))})"
            if envs
            else "steps without an environment (no env column)"
        )
        raise GagpoError(f"{what}; accepted: the steps of one environment")
    return envs[0]


def label(steps: pl.DataFrame, oracle: type[StepOracle] | None = None) -> pl.DataFrame:
    """traj_id, step, policy_version, `move` (the parsed reply, null if none) and `optimal`
    (bool) for the labelled steps, by `oracle` (default: that of the steps' environment).
    The parser and the oracle run once per distinct reply and per distinct state."""
    if oracle is None:
        oracle = oracle_of(steps_env(steps))
    replies = (
        steps.select(C.ACTION_TEXT)
        .unique()
        .with_columns(move=pl.col(C.ACTION_TEXT).map_elements(oracle.parse_move, pl.String))
    )
    states = (
        steps.select(C.STATE_KEY)
        .unique()
        .with_columns(
            best=pl.col(C.STATE_KEY).map_elements(
                lambda k: sorted(oracle.optimal_moves(k)), pl.List(pl.String)
            )
        )
    )
    return (
        steps.select(C.TRAJ_ID, C.STEP, C.POLICY_VERSION, C.GROUP_ID, C.STATE_KEY, C.ACTION_TEXT)
        .join(replies, on=C.ACTION_TEXT)
        .join(states, on=C.STATE_KEY)
        .filter(pl.col("best").list.len() > 0)  # solved or unsolvable states carry no label
        .select(
            C.TRAJ_ID,
            C.STEP,
            C.POLICY_VERSION,
            C.GROUP_ID,
            C.STATE_KEY,
            "move",
            optimal=pl.col("best").list.contains(pl.col("move")).fill_null(False),
        )
    )


def within_state_auc(scored: pl.DataFrame) -> float:
    """The AUC over the pairs (optimal, other) of moves made from the same state of the same
    group (ties ½), from average ranks within each (group, state); nan if no state had both."""
    by = [C.GROUP_ID, C.STATE_KEY]
    pools = (
        scored.with_columns(rank=pl.col(C.ADVANTAGE).rank("average").over(by))
        .group_by(by)
        .agg(
            n=pl.len(),
            pos=pl.col("optimal").sum(),
            rank_sum=pl.col("rank").filter(pl.col("optimal")).sum(),
        )
        .filter((pl.col("pos") > 0) & (pl.col("pos") < pl.col("n")))
    )
    pairs = (pools["pos"] * (pools["n"] - pools["pos"])).sum()
    if not pairs:
        return float("nan")
    wins = (pools["rank_sum"] - pools["pos"] * (pools["pos"] + 1) / 2).sum()
    return float(wins / pairs)


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Mann–Whitney AUC of `scores` for `positive` against the rest (average ranks for ties)."""
    ranks = pl.Series(scores).rank("average").to_numpy()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if not n_pos or not n_neg:
        return float("nan")
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def credit_auc(scored: pl.DataFrame) -> dict[str, float]:
    """Credit AUC and within-state AUC of labelled steps (`label`'s columns) joined with
    their `advantage`; nan where a side is missing. `gagpo view` shows the same numbers
    for one group or trajectory (workflows/view.py)."""
    return {
        "auc": auc(scored[C.ADVANTAGE].to_numpy(), scored["optimal"].to_numpy()),
        "state_auc": within_state_auc(scored),
    }


# --- the comparison -----------------------------------------------------------------------


@dataclass
class Comparison:
    """The credit table of one store: a row per estimator, and the labelled steps."""

    rows: list[dict]
    steps: int
    labelled: pl.DataFrame  # traj_id, step, policy_version, move, optimal
    advantages: dict[str, pl.DataFrame]  # label → traj_id, step, group_id, advantage


def estimators(run_estimator: EstimatorConfig | None = None) -> list[tuple[str, EstimatorConfig]]:
    """GRPO, GiGPO, GAGPO λ=0 and GAGPO at the run's λ (0.8 when the run used another
    estimator), all with the run's γ and state grouping, as (label, config)."""
    shared = {"gamma": 0.95}
    lam = 0.8
    if run_estimator is not None:
        shared = {"gamma": run_estimator.gamma, "state_grouping": run_estimator.state_grouping}
        lam = getattr(run_estimator, "lam", lam) if run_estimator.estimator == "gagpo" else lam
    return [
        ("GRPO", parse_estimator_config({"estimator": "grpo", **shared})),
        ("GiGPO", parse_estimator_config({"estimator": "gigpo", **shared})),
        ("GAGPO λ=0", parse_estimator_config({"estimator": "gagpo_lambda0", **shared})),
        (f"GAGPO λ={lam:g}", parse_estimator_config({"estimator": "gagpo", "lam": lam, **shared})),
    ]


def read_steps(store, env: str | None = None, columns=STEP_COLUMNS) -> pl.DataFrame:
    """The store's committed, valid steps (`columns`), all of them of `env` (default: of
    one environment, whichever it is)."""
    from gagpo.storage.archive import read_steps_table

    steps = pl.from_arrow(read_steps_table(store, list(columns)))  # archive and inbox
    if steps.height == 0:
        raise GagpoError(f"no committed shard in {store.url}; accepted: a store a run wrote")
    if env is None:
        steps_env(steps)
    elif (steps[C.ENV] != env).any():
        raise GagpoError(
            f"the store holds steps of other environments than {env}; accepted: "
            f"a store of --env {env} runs only"
        )
    return steps


def oracle_env(store: Store | str) -> str | None:
    """The environment of the store's steps when it declares a step oracle (the credit
    comparison needs one), else None; a one-line error for a store without steps."""
    env = steps_env(read_steps(_opened(store), columns=[C.ENV]))
    return env if step_oracle(env) is not None else None


def compare(
    store: Store | str, run_estimator: EstimatorConfig | None = None, env: str | None = None
) -> Comparison:
    """Recompute the store's steps under each estimator (committed under advantages/<tag>/)
    and measure each one's credit against the step oracle of `env` (default: the steps'
    own environment)."""
    from gagpo.pipeline.recompute import recompute_store
    from gagpo.storage.archive import step_files

    store = _opened(store)
    steps = read_steps(store, env)
    labelled = label(steps, oracle_of(env or steps_env(steps)))
    rows, tables = [], {}
    for name, config in estimators(run_estimator):
        recompute_store(store.url, None, config)
        files = [store.advantages_path(config.tag, i) for i in step_files(store).ids()]
        adv = pl.concat(
            [
                pl.from_arrow(store.read_table(f, [C.GROUP_ID, C.TRAJ_ID, C.STEP, C.ADVANTAGE]))
                for f in files
                if store.exists(f)
            ]
        )
        tables[name] = adv
        x = adv[C.ADVANTAGE].to_numpy()
        q1, q3 = np.quantile(x, [0.25, 0.75])
        scored = labelled.join(adv.drop(C.GROUP_ID), on=[C.TRAJ_ID, C.STEP])
        rows.append(
            {
                "estimator": name,
                "tag": config.tag,
                "steps": len(x),
                "zero_share": float((np.abs(x) < ZERO).mean()),
                "iqr": float(q3 - q1),
                **credit_auc(scored),
                "labelled_steps": scored.height,
            }
        )
    return Comparison(rows, steps.height, labelled, tables)


def table(comparison: Comparison) -> str:
    """The printed credit table."""
    c = comparison
    optimal = c.labelled["optimal"].mean() if c.labelled.height else float("nan")
    lines = [
        f"credit on this run's own {c.steps} steps, recomputed (no training); the solver "
        f"labels {c.labelled.height} moves ({optimal:.0%} optimal)",
        "estimator      zero_advantage  advantage_IQR  credit_AUC  within_a_state",
    ]
    for r in c.rows:
        lines.append(
            f"{r['estimator']:<13}  {r['zero_share']:>14.1%}  {r['iqr']:>13.3f}  "
            f"{r['auc']:>10.3f}  {r['state_auc']:>14.3f}"
        )
    return "\n".join(lines)


# --- the figure -------------------------------------------------------------------------------


def pick_trajectory(comparison: Comparison) -> str | None:
    """A trajectory that shows the difference, with optimal and other moves both labelled:
    preferably in a group where GRPO gives no credit at all, then of the newest version,
    with the most labelled moves, then the smallest id."""
    lab = comparison.labelled.group_by(C.TRAJ_ID).agg(
        version=pl.col(C.POLICY_VERSION).max(), labelled=pl.len(), optimal=pl.col("optimal").sum()
    )
    lab = lab.filter((pl.col("optimal") > 0) & (pl.col("optimal") < pl.col("labelled")))
    if not lab.height:
        return None
    grpo = comparison.advantages["GRPO"]
    silent = grpo.group_by(C.GROUP_ID).agg(
        silent=(pl.col(C.ADVANTAGE).abs() < ZERO).all(), trajs=pl.col(C.TRAJ_ID).unique()
    )
    silent = silent.explode("trajs").select(pl.col("trajs").alias(C.TRAJ_ID), "silent")
    best = lab.join(silent, on=C.TRAJ_ID, how="left").sort(
        ["silent", "version", "labelled", C.TRAJ_ID],
        descending=[True, True, True, False],
        nulls_last=True,
    )
    return best[C.TRAJ_ID][0]


def credit_figure(comparison: Comparison, traj_id: str, path: Path) -> Path:
    """One trajectory's advantages under each estimator, turn by turn; the turns whose move
    is optimal are marked green, the others red (unlabelled turns: grey)."""
    from gagpo.schemas.extras import require

    require("report", "the credit figure")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    marks = comparison.labelled.filter(pl.col(C.TRAJ_ID) == traj_id)
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    turns: list[int] = []
    for i, (name, adv) in enumerate(comparison.advantages.items()):
        one = adv.filter(pl.col(C.TRAJ_ID) == traj_id).sort(C.STEP)
        turns = one[C.STEP].to_list()
        ax.plot(
            turns,
            one[C.ADVANTAGE].to_list(),
            "o-",
            markersize=4,
            label=name,
            color=plt.get_cmap("tab10")(i),
        )
    optimal = dict(zip(marks[C.STEP].to_list(), marks["optimal"].to_list(), strict=True))
    moves = dict(zip(marks[C.STEP].to_list(), marks["move"].to_list(), strict=True))
    for t in turns:
        colour = {True: "tab:green", False: "tab:red"}.get(optimal.get(t), "0.8")
        ax.axvspan(t - 0.45, t + 0.45, color=colour, alpha=0.12, linewidth=0)
    ax.axhline(0.0, color="0.3", linewidth=0.8)
    ax.set_xticks(turns, [f"{t}\n{moves.get(t) or '·'}" for t in turns], fontsize=8)
    ax.set_xlabel("turn and move (green: optimal per the solver; red: not; grey: no label)")
    ax.set_ylabel("advantage")
    ax.set_title(f"one trajectory's credit under each estimator ({traj_id[:12]}…)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def credit_report(
    store: Store | str, run_estimator: EstimatorConfig | None, out_dir: Path, env: str | None = None
) -> tuple[Comparison, list[str]]:
    """Compare (against the oracle of `env`, default the steps' own environment), draw the
    figure into `out_dir`; the comparison and its printed lines (the table, the SQL query to
    rerun, where the figure is)."""
    store = _opened(store)
    comparison = compare(store, run_estimator, env)
    lines = [
        table(comparison),
        f'rerun (zero share, IQR): gagpo sql --store {store.url} "{SQL_QUERY}"',
    ]
    traj = pick_trajectory(comparison)
    if traj is None:
        lines.append("credit figure: none (no trajectory with optimal and other moves labelled)")
    else:
        path = credit_figure(comparison, traj, Path(out_dir) / FIGURE)
        lines.append(f"credit figure: {path} (trajectory {traj})")
    return comparison, lines


def _opened(store: Store | str) -> Store:
    """The command's opened store; a URL (a test, a notebook) is opened here."""
    return store if isinstance(store, Store) else Store(store)

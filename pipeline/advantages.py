"""The advantage stage (docs/design.md §4) as one lazy Polars plan over the steps table.

    compute_advantages(steps, config) -> advantages      (both LazyFrames)

Every estimator shares the grouped quantities of §4.1–3, computed once:

    return            G_t = Σ_{k≥t} γ^(k−t) r_k                   within the rollout
    value_proxy       V̂_g(s) = mean of G over the group's steps in state s (own step included)
    state_group_size  how many of the group's steps are in that state
    next_value_proxy  V̂_g(s_{t+1}); 0 after `done`; after `truncated`, V̂_g(next_state_key)
                      if that state occurs in the group, else 0
    td_residual       δ_t = r_t + γ·next_value_proxy − value_proxy

and each estimator then adds `advantage_raw` (before normalisation) and `advantage`:

    gagpo, gagpo_lambda0/1   raw = GAE Σ_l (γλ)^l δ_{t+l};  advantage = norm(raw) + ω_E·A_E
    gigpo                    raw = step advantage (G_t − V̂)/(pool std + ε | 1);
                             advantage = A_E(norm) + ω·raw  (variant verl_agent: sample
                             stds, A_E over step rows; see `gigpo`)
    grpo                     raw = episode return R;         advantage = norm over rollouts
    rloo                     raw = R − mean of the other rollouts' R;  advantage = norm(raw)

R is the undiscounted sum of a rollout's rewards and A_E its GRPO advantage (R z-scored
over the group's rollouts). Step-level norms run over all steps of the group (or batch),
episode-level ones over rollouts, one value per rollout. Every std is the population std.

No Python loop touches rows or groups. Plain per-group sums are expressions with `.over`;
rollout ids, the checked layout, the state pools, the within-rollout recurrences and the
normalisations are whole-column NumPy kernels run inside the plan (`scan.py`: exact
level-layout scans; `pools.py`: hashed pools checked exactly, bincount moments), where
they beat a string group-by, a sort or a window expression several times over on the
benchmark (benchmarks/bench_advantages.py). Row order is free on input, kept on output.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import polars as pl

from gagpo.pipeline.checks import check_and_layout, check_schema
from gagpo.pipeline.config import EstimatorConfig
from gagpo.pipeline.grouping import Grouping, group_states, parse_grouping
from gagpo.pipeline.pools import NO_POOL, grouped_values, pool_spread, standardise
from gagpo.pipeline.scan import INDEX, MAX_ROWS, discounted_sum, next_in_rollout
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError

# Internal columns, dropped before output.
TID, GID = "_tid", "_gid"  # dense rollout and group ids
POS, REM = "_pos", "_rem"  # level layout (scan.py): position, steps left in the rollout
POOL, NEXT_POOL = "_pool", "_next_pool"  # state pool of the step / of next_state_key
POOL_ID = "pool_id"  # with `pool_ids=True`: the label of the step's pool (grouping.py)
EPISODE_RETURN = "_episode_return"  # undiscounted sum of the rollout's rewards

# Polars dtypes of the advantages table (docs/design.md §3), in column order.
OUTPUT_SCHEMA: pl.Schema = pl.from_arrow(C.ADVANTAGES_SCHEMA.empty_table()).schema  # type: ignore[union-attr]

Estimator = Callable[[pl.LazyFrame, Any], pl.LazyFrame]
ESTIMATORS: dict[str, Estimator] = {}


def register(*names: str) -> Callable[[Estimator], Estimator]:
    """Add an estimator: a function (frame with the shared columns, config) -> frame with
    ADVANTAGE_RAW and ADVANTAGE, plus its config variant in `config.py`."""

    def add(fn: Estimator) -> Estimator:
        for name in names:
            ESTIMATORS[name] = fn
        return fn

    return add


# --- whole-column kernels inside the plan ------------------------------------------


def _kernel(fn: Callable[..., tuple], outputs: dict[str, Any], **inputs: pl.Expr) -> pl.Expr:
    """Run `fn(**columns)` on whole columns (Series by keyword) inside the lazy plan;
    it returns one array per name of `outputs`, and the expression is their struct.

    Used where one vectorised NumPy pass beats expressions (see the module docstring).
    """

    def run(batch: pl.Series) -> pl.Series:
        arrays = fn(**{name: batch.struct.field(name) for name in inputs})
        return pl.DataFrame(
            [
                pl.Series(name, a, dtype)
                for (name, dtype), a in zip(outputs.items(), arrays, strict=True)
            ]
        ).to_struct()

    struct = pl.struct(*(expr.alias(name) for name, expr in inputs.items()))
    return struct.map_batches(run, return_dtype=pl.Struct(outputs))


def _with_kernel(frame: pl.LazyFrame, kernel: pl.Expr) -> pl.LazyFrame:
    return frame.with_columns(kernel.alias("_kernel")).unnest("_kernel")


def _dense_ids(keys: pl.Series) -> np.ndarray:
    """Dense integer ids of a string key. Rollouts (and groups) are usually stored as
    contiguous runs; when no key starts two runs the run number is the id, otherwise
    the runs' keys are ranked (exact either way)."""
    if keys.len() == 0:
        return np.zeros(0, INDEX)
    if keys.len() > MAX_ROWS:
        raise GagpoError(f"a batch holds at most {MAX_ROWS} steps; split the input")
    runs = keys.rle_id().to_numpy().astype(INDEX)
    starts = np.flatnonzero(runs[1:] != runs[:-1]) + 1
    heads = keys.gather(np.concatenate(([0], starts)))  # each run's key
    if heads.n_unique() == heads.len():
        return runs
    # (A null key gets id 0 here; check_and_layout rejects it.)
    return (heads.rank("dense") - 1).fill_null(0).to_numpy().astype(INDEX)[runs]


def _structure(
    *,
    group_id,
    traj_id,
    step,
    state_key,
    next_state_key,
    reward,
    done,
    truncated,
    grouping: Grouping,
    labels: bool = False,
) -> tuple[Any, ...]:
    """Ids, checked level layout, the pool of each step's state under `grouping` and the
    pool of the state after it: the next step's, or at a truncated end the pool
    next_state_key maps to (NO_POOL after `done` or when it matches none of the group's);
    with `labels`, each step's pool label too."""
    tid, gid = _dense_ids(traj_id), _dense_ids(group_id)
    pos, rem = check_and_layout(
        group_id=group_id,
        traj_id=traj_id,
        step=step,
        state_key=state_key,
        reward=reward,
        done=done,
        truncated=truncated,
        tid=tid,
        gid=gid,
    )
    ask = (rem == 0) & ~done.to_numpy() & next_state_key.is_not_null().to_numpy()
    pools = group_states(
        grouping, gid, state_key, gid[ask], next_state_key.filter(pl.Series(ask)), group_id
    )
    pool = pools.pool
    next_pool = next_in_rollout(pool, pos, rem, NO_POOL)
    next_pool[ask] = pools.query_pool
    if labels:
        return tid, gid, pos, rem, pool, next_pool, pools.label().gather(pool)
    return tid, gid, pos, rem, pool, next_pool


def _values(*, reward, pos, rem, pool, next_pool, gamma: float) -> tuple[np.ndarray, ...]:
    """return, value_proxy, next_value_proxy, state_group_size, td_residual (§4.1–3)."""
    r = reward.to_numpy()
    returns = discounted_sum(r, pos.to_numpy(), rem.to_numpy(), gamma)
    value, next_value, size = grouped_values(returns, pool.to_numpy(), next_pool.to_numpy())
    td = next_value * gamma  # δ = r + γ·V̂(next) − V̂(s), in place
    td += r
    td -= value
    return returns, value, next_value, size, td


def _discounted_sum(value: str, c: float) -> pl.Expr:
    """Σ_{k≥t} c^(k−t)·value_k within each rollout, exact (see scan.py)."""

    def run(value: pl.Series, pos: pl.Series, rem: pl.Series) -> tuple[np.ndarray]:
        return (discounted_sum(value.to_numpy(), pos.to_numpy(), rem.to_numpy(), c),)

    sums = _kernel(run, {"x": pl.Float64}, value=pl.col(value), pos=pl.col(POS), rem=pl.col(REM))
    return sums.struct.field("x")


# --- shared columns ----------------------------------------------------------------


def _shared_columns(
    steps: pl.LazyFrame, gamma: float, grouping: Grouping, labels: bool = False
) -> pl.LazyFrame:
    """The needed columns in float64, internal ids and layout, the state pools under
    `grouping` (with `labels`, POOL_ID too), and the estimator-free columns of the
    advantages table: return, value proxies, pool size, TD residual."""
    frame = steps.select(
        pl.col(C.GROUP_ID),
        pl.col(C.TRAJ_ID),
        pl.col(C.STEP),
        pl.col(C.STATE_KEY),
        pl.col(C.NEXT_STATE_KEY).cast(pl.String),
        pl.col(C.REWARD).cast(pl.Float64),
        pl.col(C.DONE),
        pl.col(C.TRUNCATED),
    )
    outputs = {name: pl.Int64 for name in (TID, GID, POS, REM, POOL, NEXT_POOL)}
    structure = _kernel(
        partial(_structure, grouping=grouping, labels=labels),
        {**outputs, POOL_ID: pl.String} if labels else outputs,
        **{name: pl.col(name) for name in C.ADVANTAGE_INPUT_COLUMNS},
    )
    frame = _with_kernel(frame, structure)
    values = _kernel(
        partial(_values, gamma=gamma),
        {
            C.RETURN: pl.Float64,
            C.VALUE_PROXY: pl.Float64,
            C.NEXT_VALUE_PROXY: pl.Float64,
            C.STATE_GROUP_SIZE: pl.Int64,
            C.TD_RESIDUAL: pl.Float64,
        },
        reward=pl.col(C.REWARD),
        pos=pl.col(POS),
        rem=pl.col(REM),
        pool=pl.col(POOL),
        next_pool=pl.col(NEXT_POOL),
    )
    return _with_kernel(frame, values).with_columns(
        pl.col(C.REWARD).sum().over(TID).alias(EPISODE_RETURN)
    )


# --- normalisation -----------------------------------------------------------------


def _normalise(
    value: pl.Expr, norm: str, eps: float, *, per_rollout: bool, ddof: int = 0
) -> pl.Expr:
    """§4.5 normalisation of `value` over the group's steps (or the batch's), or over its
    rollouts, one value per rollout (taken at its last step), when `per_rollout`; the
    population std, or the Bessel-corrected one with `ddof` = 1.

    A whole-column kernel: bincount moments are several times faster than `.over`.
    """
    if norm == "none":
        return value

    def run(value: pl.Series, gid: pl.Series, rem: pl.Series) -> tuple[np.ndarray]:
        x = value.to_numpy()
        groups = np.zeros(x.shape[0], np.intp) if norm == "batch" else gid.to_numpy()
        sample = rem.to_numpy() == 0 if per_rollout else None
        return (standardise(x, groups, eps, sample=sample, divide=norm != "mean", ddof=ddof),)

    kernel = _kernel(run, {"x": pl.Float64}, value=value, gid=pl.col(GID), rem=pl.col(REM))
    return kernel.struct.field("x")


def _episode_advantage(norm: str, eps: float) -> pl.Expr:
    return _normalise(pl.col(EPISODE_RETURN), norm, eps, per_rollout=True)


# --- estimators --------------------------------------------------------------------


@register("gagpo", "gagpo_lambda0", "gagpo_lambda1")
def gagpo(frame: pl.LazyFrame, config: Any) -> pl.LazyFrame:
    """GAE over the grouped-value TD residuals, normalised over the group's steps."""
    gae = _discounted_sum(C.TD_RESIDUAL, config.gamma * config.lam)
    frame = frame.with_columns(gae.alias(C.ADVANTAGE_RAW))
    advantage = _normalise(pl.col(C.ADVANTAGE_RAW), config.norm, config.eps, per_rollout=False)
    if config.omega_episode:
        advantage = advantage + config.omega_episode * _episode_advantage("group", config.eps)
    return frame.with_columns(advantage.alias(C.ADVANTAGE))


@register("gigpo")
def gigpo(frame: pl.LazyFrame, config: Any) -> pl.LazyFrame:
    """Episode advantage + ω · anchor-state step advantage (a singleton pool gives 0).

    Variant `paper` (Feng et al., GiGPO, 2025, as in docs/design.md §4): population stds,
    A_E over the group's rollouts. Variant `verl_agent` follows verl-agent's core_gigpo.py:
    sample stds (torch.std, ddof = 1) and A_E taken over step rows (every step of a
    rollout carries its return R, so long rollouts weigh more); a scope holding a single
    row gets mean 0 and std 1 there, so its A_E is R/(1 + ε) (R with norm = mean)."""
    verl = config.variant == "verl_agent"
    ddof = 1 if verl else 0
    step_advantage = pl.col(C.RETURN) - pl.col(C.VALUE_PROXY)
    if config.step_std:

        def std(returns: pl.Series, pool: pl.Series) -> tuple[np.ndarray]:
            return (pool_spread(returns.to_numpy(), pool.to_numpy(), ddof),)

        spread = _kernel(std, {"std": pl.Float64}, returns=pl.col(C.RETURN), pool=pl.col(POOL))
        step_advantage = step_advantage / (spread.struct.field("std") + config.eps)
    if verl:
        episode = _normalise(
            pl.col(EPISODE_RETURN), config.norm, config.eps, per_rollout=False, ddof=1
        )
        if config.norm != "none":
            rows = pl.len() if config.norm == "batch" else pl.len().over(GID)
            alone = pl.col(EPISODE_RETURN) / (1.0 if config.norm == "mean" else 1.0 + config.eps)
            episode = pl.when(rows == 1).then(alone).otherwise(episode)
    else:
        episode = _episode_advantage(config.norm, config.eps)
    return frame.with_columns(step_advantage.alias(C.ADVANTAGE_RAW)).with_columns(
        (episode + config.omega * pl.col(C.ADVANTAGE_RAW)).alias(C.ADVANTAGE)
    )


@register("grpo")
def grpo(frame: pl.LazyFrame, config: Any) -> pl.LazyFrame:
    """Episode return normalised over the group's rollouts, broadcast to every step."""
    return frame.with_columns(
        pl.col(EPISODE_RETURN).alias(C.ADVANTAGE_RAW),
        _episode_advantage(config.norm, config.eps).alias(C.ADVANTAGE),
    )


@register("rloo")
def rloo(frame: pl.LazyFrame, config: Any) -> pl.LazyFrame:
    """Episode return minus the mean return of the group's other rollouts."""
    episode = pl.col(EPISODE_RETURN)
    one = pl.when(pl.col(REM) == 0).then(episode)  # one value per rollout
    n, total = one.count().over(GID), one.sum().over(GID)
    leave_one_out = pl.when(n > 1).then(episode - (total - episode) / (n - 1)).otherwise(0.0)
    frame = frame.with_columns(leave_one_out.alias(C.ADVANTAGE_RAW))
    advantage = _normalise(pl.col(C.ADVANTAGE_RAW), config.norm, config.eps, per_rollout=True)
    return frame.with_columns(advantage.alias(C.ADVANTAGE))


# --- the stage ---------------------------------------------------------------------


def compute_advantages(
    steps: pl.LazyFrame, config: EstimatorConfig, *, pool_ids: bool = False
) -> pl.LazyFrame:
    """The advantages table (docs/design.md §3) of `steps` under `config`, as a lazy plan.

    Steps share a value-proxy pool under `config.state_grouping` (grouping.py); with
    `pool_ids`, a last column POOL_ID names each step's pool (what the SQL views show).

    `steps` needs the columns of `ADVANTAGE_INPUT_COLUMNS`, in any row order; it is one
    batch (groups never mix; `batch` normalisation spans it). Missing or mistyped
    columns raise `ValidationError` now; bad rows (nulls, non-finite rewards, duplicate
    or missing steps, flags before a rollout's end, open-ended rollouts) raise it when
    the plan is collected. Math is float64; rows come out in input order.
    """
    if isinstance(steps, pl.DataFrame):
        steps = steps.lazy()
    check_schema(steps.collect_schema())
    grouping = parse_grouping(config.state_grouping)
    frame = _shared_columns(steps, config.gamma, grouping, labels=pool_ids)
    frame = ESTIMATORS[config.estimator](frame, config)
    columns = [pl.col(name).cast(dtype) for name, dtype in OUTPUT_SCHEMA.items()]
    return frame.select(*columns, *([pl.col(POOL_ID)] if pool_ids else []))

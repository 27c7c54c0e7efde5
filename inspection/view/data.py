"""What the pages of `gagpo view` read, as plain functions over a `StoreSession`.

Every read goes through the `gagpo sql` sandbox (inspection/sql.py: `open_store_db`,
`run_query`, `query_store`), the store's one reader: a locked-down DuckDB connection over
the store's committed files, bounded in time and memory. A session keeps one connection
per store and opens it again after `REFRESH_S` seconds (new shards appear) or when a query
meets a file a compaction removed (its groups are in a segment now).

A group page reads that group's rows only: `WHERE group_id = ?`, which DuckDB pushes
down into the scans (the archive's segments are sorted by group id, so their row-group
statistics skip the rest: benchmarks/bench_view.py shows one row group read of the
store's). Values from the URL enter queries as prepared-statement parameters, never as
SQL text (`check_id` still gives a bad one its one-line 400). The page's drift marks and
window slides come from the `prompt_drift` view read the same way: its window is
partitioned by group and rollout, so the filter on group_id reaches the scans through it.
The pools page reads through the same session (inspection/view/pools.py).

Where the environment has a step oracle (Sokoban's solver), the compare page shows each
estimator's credit AUC and which moves were optimal. The oracle lives with the
environments (actors/), which this layer may not import: `gagpo view` (workflows/view.py)
passes it in as a `StepOracle`.

Estimators other than the stored tables are recomputed for that group only, by the
advantage stage itself (`compute_advantages` on the group's rows), so they equal
`gagpo advantages` on a file holding the group.
"""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Protocol

import polars as pl
import pyarrow as pa

from gagpo.inspection.arguments import DEFAULT_GAMMA, VIEW_TIMEOUT_S
from gagpo.inspection.intervals import wilson
from gagpo.inspection.sql import (
    Limits,
    close_store_db,
    open_store_db,
    query_store,
    run_query,
)
from gagpo.pipeline.advantages import POOL_ID, compute_advantages
from gagpo.pipeline.config import ESTIMATOR_NAMES, parse_estimator_config
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.storage.archive import is_missing_file

REFRESH_S = 15.0  # a page opened later than this after the last one sees new shards
ZERO = 1e-6  # |advantage| below this counts as no credit (as workflows/credit.py)
MAX_OBSERVATION = 20_000  # characters of one observation sent to the page
STORED = "stored:"  # estimator choice prefix of a stored advantage tag

# Ids and tags from the URL: what the store writes (ULIDs, tags such as
# `gagpo-gamma_0.95-…-lam_0.8@u3`, task ids), nothing that needs quoting beyond `'`.
_ID = re.compile(r"^[A-Za-z0-9_.:@+\-=/ ]{1,300}$")


class NotFound(GagpoError):
    """What the URL names is not in the store (a 404)."""


def check_id(value: str, what: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        shown = repr(value)[:80]
        raise GagpoError(f"{what} {shown} is not an id; accepted: letters, digits and _.:@+-=/")
    return value


# --- the connection of one store -------------------------------------------------------


@dataclass
class StoreSession:
    """One store of the app: its label, URL, the sandbox's limits and its connection."""

    label: str
    url: str
    limits: Limits = field(default_factory=lambda: Limits(timeout_s=VIEW_TIMEOUT_S))
    gamma: float = DEFAULT_GAMMA
    _con: Any = None
    _opened: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def query(self, sql: str, params: list | dict | None = None) -> pa.Table:
        """`sql` with the values of its `?` / `$name` parameters on this store's connection
        (one query at a time)."""
        with self._lock:
            for attempt in range(5):
                if self._con is None or time.monotonic() - self._opened > REFRESH_S:
                    self._reopen()
                try:
                    return run_query(self._con, sql, self.limits, params)
                except GagpoError as exc:
                    if attempt == 4 or not is_missing_file(exc):
                        raise
                    self._close()  # a compaction moved a file: the store as it stands now
        raise AssertionError("unreachable")

    def rows(self, sql: str, params: list | dict | None = None) -> list[dict]:
        return self.query(sql, params).to_pylist()

    def fresh_query(self, sql: str, limits: Limits) -> pa.Table:
        """`sql` exactly as `gagpo sql` runs it: a fresh connection, closed after (the SQL
        page: temporary tables a user creates vanish with it)."""
        return query_store(self.url, sql, gamma=self.gamma, limits=limits)

    def _reopen(self) -> None:
        self._close()
        self._con = open_store_db(self.url, gamma=self.gamma, limits=self.limits)
        self._opened = time.monotonic()

    def _close(self) -> None:
        if self._con is not None:
            close_store_db(self._con)
            self._con = None

    def close(self) -> None:
        with self._lock:
            self._close()


# --- the run page ----------------------------------------------------------------------

LEARNER_COLUMNS = (
    "loss",
    "pg_loss",
    "approx_kl",
    "kl_ref",
    "clip_frac",
    "entropy",
    "behavior_weight_mean",
    "behavior_weight_max",
    "mismatch_kl",
    "staleness_mean",
    "staleness_max",
    "stale_groups",
    "stale_groups_total",
    "tokens_per_s",
    "update_s",
    "wait_s",
    "grad_norm",
    "lr",
    "groups",
    "steps",
    "time",
)


def run_data(session: StoreSession) -> dict:
    """Learning curves per policy version, held-out success with its 95 % Wilson band,
    actor throughput per version, and the learner's metrics per update."""
    versions = session.rows(
        "SELECT version, published, steps, trajectories, groups, success_rate, mean_return, "
        "epoch(last_step_at) - epoch(first_step_at) AS seconds FROM policy_versions "
        "WHERE steps > 0 ORDER BY version"
    )
    for row in versions:  # environment steps per second of the actors, per version
        seconds = row.pop("seconds")
        row["steps_per_s"] = row["steps"] / seconds if seconds and seconds > 0 else None
    heldout = session.rows(
        "SELECT policy_version, rollouts, success_rate, mean_return "
        "FROM heldout ORDER BY policy_version"
    )
    for row in heldout:
        n = int(row["rollouts"] or 0)
        low, high = wilson((row["success_rate"] or 0.0) * n, n)
        row["low"], row["high"] = low, high
    present = {
        row["column_name"]
        for row in session.rows(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'learner_metrics'"
        )
    }
    wanted = [name for name in LEARNER_COLUMNS if name in present]
    learner = session.rows(
        'SELECT "update", version'
        + "".join(f', "{name}"' for name in wanted)
        + ' FROM learner_metrics ORDER BY "update"'
    )
    return {"store": session.label, "versions": versions, "heldout": heldout, "learner": learner}


def group_list(
    session: StoreSession,
    *,
    version: int | None = None,
    task: str | None = None,
    order: str = "spread",
    limit: int = 50,
) -> list[dict]:
    """Groups for the choosers and the run page's table: of one policy version and task
    when given; ordered by the spread of their rollouts' returns (where credit has
    something to tell) or newest first."""
    where, params = [], []
    if version is not None:
        where.append("policy_version = ?")
        params.append(int(version))
    if task:
        where.append("task_id = ?")
        params.append(check_id(task, "task"))
    if order not in ("spread", "newest"):
        raise GagpoError(f"order {order!r} is not known; accepted: spread, newest")
    sort = (
        "max(ret) - min(ret) DESC, min(started) DESC" if order == "spread" else "min(started) DESC"
    )
    return session.rows(
        f"""
        WITH rollouts AS (
            SELECT group_id, traj_id, any_value(task_id) AS task_id,
                   min(policy_version) AS policy_version, count(*) AS steps,
                   sum(reward::DOUBLE) AS ret, bool_or(won) AS won, min(created_at) AS started
            FROM steps {"WHERE " + " AND ".join(where) if where else ""}
            GROUP BY group_id, traj_id
        )
        SELECT group_id, any_value(task_id) AS task_id, min(policy_version) AS policy_version,
               count(*) AS rollouts, sum(steps)::BIGINT AS steps, avg(won::DOUBLE) AS success_rate,
               avg(ret) AS mean_return, max(ret) - min(ret) AS return_spread
        FROM rollouts GROUP BY group_id ORDER BY {sort}, group_id LIMIT {int(limit)}
    """,
        params,
    )


def choices(session: StoreSession) -> dict:
    """What the group page's chooser offers: policy versions and stored estimator tags."""
    versions = [
        r["version"]
        for r in session.rows(
            "SELECT version FROM policy_versions WHERE steps > 0 ORDER BY version"
        )
    ]
    tags = session.rows("SELECT estimator, name, params FROM estimators ORDER BY estimator")
    return {"versions": versions, "tags": tags, "estimators": list(ESTIMATOR_NAMES)}


# --- the group page --------------------------------------------------------------------

STEP_COLUMNS = (
    C.GROUP_ID,
    C.TRAJ_ID,
    C.STEP,
    C.ENV,
    C.TASK_ID,
    C.STATE_KEY,
    C.NEXT_STATE_KEY,
    C.OBSERVATION,
    C.ACTION_TEXT,
    C.ACTION_IDS,
    C.BEHAVIOR_LOGPROBS,
    C.POLICY_VERSION,
    C.REWARD,
    C.DONE,
    C.TRUNCATED,
    C.ACTION_VALID,
    C.WON,
)
ADVANTAGE_COLUMNS = (
    C.RETURN,
    C.VALUE_PROXY,
    C.NEXT_VALUE_PROXY,
    C.TD_RESIDUAL,
    C.ADVANTAGE_RAW,
    C.ADVANTAGE,
    C.STATE_GROUP_SIZE,
)


def group_steps(session: StoreSession, group_id: str) -> pa.Table:
    """The group's steps, rollout by rollout, turn by turn; NotFound when it has none."""
    group_id = check_id(group_id, "group")
    columns = ", ".join(f'"{name}"' for name in STEP_COLUMNS)
    table = session.query(
        f"SELECT {columns} FROM steps WHERE group_id = ? ORDER BY traj_id, step", [group_id]
    )
    if table.num_rows == 0:
        raise NotFound(f"group {group_id!r} is not in store {session.label!r}")
    return table


# The drift audit of the `prompt_drift` view, per step of the group (schemas/extends.py).
DRIFT_COLUMNS = (
    "extends_previous",
    "window_slide",
    "drift",
    "shared_tokens",
    "previous_tokens",
    "prompt_tokens",
)


def group_drift(session: StoreSession, group_id: str) -> pl.DataFrame:
    """traj_id, step and DRIFT_COLUMNS of the group's steps. A step after a rollout's first
    extends the previous step's prompt + action, slides a history window (its oldest turn
    dropped: a native environment's window, or a trimmed agent history), or drifts; the
    page marks drift only and counts the slides."""
    table = session.query(
        f"SELECT traj_id, step, {', '.join(DRIFT_COLUMNS)} FROM prompt_drift WHERE group_id = ?",
        [group_id],
    )
    return pl.from_arrow(table)  # type: ignore[return-value]


def estimator_choice(choice: str, params: dict[str, Any]) -> tuple[str | None, Any]:
    """(stored tag, None) for `stored:<tag>`, else (None, the validated estimator config)
    from the page's parameters; a bad value is one GagpoError line."""
    if choice.startswith(STORED):
        return check_id(choice[len(STORED) :], "estimator tag"), None
    if choice not in ESTIMATOR_NAMES:
        raise GagpoError(
            f"estimator {choice!r} is not known; accepted: "
            f"{', '.join(ESTIMATOR_NAMES)} or stored:<tag>"
        )
    return None, parse_estimator_config({"estimator": choice, **params})


def group_advantages(
    session: StoreSession, steps: pa.Table, tag: str | None, config: Any
) -> pl.DataFrame:
    """traj_id, step, pool_id and the advantages columns of the group's steps: the stored
    table of `tag`, or the stage recomputed under `config` on these rows only."""
    if tag is not None:
        group_id = steps.column(C.GROUP_ID)[0].as_py()
        table = session.query(
            "SELECT traj_id, step, coalesce(pool_id, state_key) AS pool_id, "
            + ", ".join(f'"{name}"' for name in ADVANTAGE_COLUMNS)
            + " FROM advantages WHERE group_id = ? AND estimator = ?",
            [group_id, tag],
        )
        if table.num_rows == 0:
            raise NotFound(f"group {group_id!r} has no advantages under tag {tag!r}")
        return pl.from_arrow(table)  # type: ignore[return-value]
    frame = pl.from_arrow(steps.select(list(C.ADVANTAGE_INPUT_COLUMNS)))
    try:
        table = compute_advantages(frame.lazy(), config, pool_ids=True).collect()  # type: ignore[union-attr]
    except pl.exceptions.PolarsError as exc:
        reason = str(exc).splitlines()[0]
        raise GagpoError(f"the estimator cannot run on this group ({reason})") from None
    return table.select(C.TRAJ_ID, C.STEP, POOL_ID, *ADVANTAGE_COLUMNS)


def credit_summary(advantages: pl.Series) -> dict:
    """Zero-advantage share and interquartile range (numpy's linear quantiles)."""
    if advantages.len() == 0:
        return {"zero_share": None, "iqr": None, "max_abs": 0.0}
    q25, q75 = advantages.quantile(0.25, "linear"), advantages.quantile(0.75, "linear")
    return {
        "zero_share": float((advantages.abs() < ZERO).mean()),  # type: ignore[arg-type]
        "iqr": float(q75 - q25),  # type: ignore[operator]
        "max_abs": float(advantages.abs().max()),  # type: ignore[arg-type]
    }


def group_view(session: StoreSession, group_id: str, choice: str, params: dict) -> dict:
    """Everything the group page shows: the rollouts turn by turn with each step's credit
    under the chosen estimator, and the state pools (value proxy, members' TD residuals and
    returns)."""
    tag, config = estimator_choice(choice, params)
    steps = group_steps(session, group_id)
    advantages = group_advantages(session, steps, tag, config)
    frame = pl.from_arrow(steps).join(advantages, on=[C.TRAJ_ID, C.STEP], how="left")  # type: ignore[union-attr]
    drift = group_drift(session, group_id)
    frame = frame.join(drift, on=[C.TRAJ_ID, C.STEP], how="left").sort(C.TRAJ_ID, C.STEP)
    pools = (
        frame.group_by(POOL_ID)
        .agg(
            pl.len().alias("size"),
            pl.col(C.VALUE_PROXY).first().alias("value_proxy"),
            pl.col(C.STATE_KEY).unique().sort().alias("states"),
            pl.struct(C.TRAJ_ID, C.STEP, C.RETURN, C.TD_RESIDUAL, C.ADVANTAGE).alias("members"),
        )
        .sort("size", POOL_ID, descending=[True, False])
    )
    rollouts = []
    for (traj_id,), part in frame.group_by(C.TRAJ_ID, maintain_order=True):
        rollouts.append(
            {
                "traj_id": traj_id,
                "return": float(part[C.REWARD].sum()),
                "won": bool(part[C.WON].any()),
                "length": part.height,
                "steps": [_step(row) for row in part.iter_rows(named=True)],
            }
        )
    first = steps.slice(0, 1).to_pylist()[0]
    return {
        "store": session.label,
        "group_id": group_id,
        "env": first[C.ENV],
        "task_id": first[C.TASK_ID],
        "policy_version": first[C.POLICY_VERSION],
        "estimator": {
            "choice": choice,
            "tag": tag or config.tag,
            "params": {} if config is None else config.params(),
        },
        "summary": credit_summary(frame[C.ADVANTAGE].drop_nulls()),
        "drift": {  # steps with a previous one; drift (marked) and window slides among them
            "tested": int(frame["extends_previous"].count()),
            "drift": int(frame["drift"].sum()),
            "slides": int(frame["window_slide"].sum()),
        },
        "rollouts": rollouts,
        "pools": [
            {**row, "members": [_member(m) for m in row["members"]]}
            for row in pools.iter_rows(named=True)
        ],
    }


def _member(m: dict) -> list:
    """One step of a pool: rollout, turn, return, TD residual, advantage."""
    return [m[C.TRAJ_ID], m[C.STEP], m[C.RETURN], m[C.TD_RESIDUAL], m[C.ADVANTAGE]]


def _step(row: dict) -> dict:
    observation = row[C.OBSERVATION] or ""
    if len(observation) > MAX_OBSERVATION:
        observation = observation[:MAX_OBSERVATION] + f"\n… ({len(row[C.OBSERVATION])} characters)"
    ids, logprobs = row[C.ACTION_IDS] or [], row[C.BEHAVIOR_LOGPROBS] or []
    return {
        "step": row[C.STEP],
        "state_key": row[C.STATE_KEY],
        "pool_id": row[POOL_ID],
        "observation": observation,
        "action": row[C.ACTION_TEXT],
        "reward": row[C.REWARD],
        "valid": row[C.ACTION_VALID],
        "won": row[C.WON],
        "done": row[C.DONE],
        "truncated": row[C.TRUNCATED],
        "tokens": [[i, lp] for i, lp in zip(ids, logprobs, strict=False)] if logprobs else [],
        **{name: row[name] for name in ADVANTAGE_COLUMNS},
        **{name: row[name] for name in DRIFT_COLUMNS},
    }


class StepOracle(Protocol):
    """An environment's judge of single moves (workflows/view.py: Sokoban's solver)."""

    name: str  # shown on the compare page

    def label(self, steps: pl.DataFrame) -> pl.DataFrame | None:
        """traj_id, step, `move` and `optimal` (bool) of the steps it can judge (a group's
        rows, STEP_COLUMNS); None when the steps are not of its environment."""
        ...

    def score(self, scored: pl.DataFrame) -> dict[str, float]:
        """`auc` and `state_auc` of labelled steps joined with their `advantage`."""
        ...


def compare_view(
    session: StoreSession,
    group_id: str,
    choices_: list[tuple[str, dict]],
    oracle: StepOracle | None = None,
    traj_id: str | None = None,
) -> dict:
    """One group, or one of its rollouts (`traj_id`), under several estimators: each step's
    advantage per estimator, and the zero-advantage share and IQR of each; with an oracle
    for the environment, which moves were optimal and each estimator's credit AUC over the
    steps shown. Advantages are always those of the whole group."""
    steps = group_steps(session, group_id)
    frame = pl.from_arrow(steps)
    if traj_id is not None:
        traj_id = check_id(traj_id, "rollout")
        if traj_id not in frame[C.TRAJ_ID]:  # type: ignore[index]
            raise NotFound(f"rollout {traj_id!r} is not in group {group_id!r}")
    shown = frame if traj_id is None else frame.filter(pl.col(C.TRAJ_ID) == traj_id)  # type: ignore[union-attr]
    base = shown.select(C.TRAJ_ID, C.STEP, C.STATE_KEY, C.ACTION_TEXT, C.REWARD, C.ACTION_VALID)  # type: ignore[union-attr]
    labels = oracle.label(shown) if oracle is not None else None  # type: ignore[arg-type]
    if labels is not None:
        base = base.join(
            labels.select(C.TRAJ_ID, C.STEP, "move", "optimal"), on=[C.TRAJ_ID, C.STEP], how="left"
        )
    columns, summaries = [], []
    for i, (choice, params) in enumerate(choices_):
        tag, config = estimator_choice(choice, params)
        table = group_advantages(session, steps, tag, config)
        table = table.join(base.select(C.TRAJ_ID, C.STEP), on=[C.TRAJ_ID, C.STEP], how="semi")
        name = f"a{i}"
        base = base.join(
            table.select(C.TRAJ_ID, C.STEP, pl.col(C.ADVANTAGE).alias(name)),
            on=[C.TRAJ_ID, C.STEP],
            how="left",
        )
        columns.append({"choice": choice, "tag": tag or config.tag})
        summary = credit_summary(table[C.ADVANTAGE])
        if labels is not None:
            scored = labels.join(
                table.select(C.TRAJ_ID, C.STEP, C.ADVANTAGE), on=[C.TRAJ_ID, C.STEP]
            )
            summary.update(oracle.score(scored), labelled=scored.height)  # type: ignore[union-attr]
        summaries.append(summary)
    base = base.sort(C.TRAJ_ID, C.STEP)
    judged = None
    if labels is not None:
        judged = {
            "name": oracle.name,
            "labelled": labels.height,  # type: ignore[union-attr]
            "optimal": int(labels["optimal"].sum()),
        }
    return {
        "store": session.label,
        "group_id": group_id,
        "traj_id": traj_id,
        "trajectories": frame[C.TRAJ_ID].unique(maintain_order=True).to_list(),  # type: ignore[index]
        "estimators": columns,
        "summaries": summaries,
        "oracle": judged,
        "rows": [
            {
                "traj_id": r[C.TRAJ_ID],
                "step": r[C.STEP],
                "state_key": r[C.STATE_KEY],
                "action": r[C.ACTION_TEXT],
                "reward": r[C.REWARD],
                "valid": r[C.ACTION_VALID],
                "move": r.get("move"),
                "optimal": r.get("optimal"),
                "advantages": [r[f"a{i}"] for i in range(len(choices_))],
            }
            for r in base.iter_rows(named=True)
        ],
    }


# --- JSON ------------------------------------------------------------------------------


def plain(value: Any) -> Any:
    """JSON-ready: NaN and infinities as null, timestamps and other objects as text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, Decimal):  # DuckDB's sum of integers
        return int(value) if value == value.to_integral_value() else float(value)
    return str(value)

"""The store as a library: `gagpo.open_store(url)` in a notebook, one call.

    import gagpo
    import polars as pl

    store = gagpo.open_store("runs/a")  # or "s3://bucket/run", as_of_update=12
    store.steps().filter(pl.col("reward") > 0).collect()
    store.sql("SELECT env, avg(success_rate) FROM groups GROUP BY env")

The frames are the views of `gagpo sql`, read through the same connection
(inspection/sql.py `open_store_db`): the same listing of the archive's segments and the
inbox tail, each group in exactly one file (storage/archive.py), the same read-only
sandbox, the same `--as-of-update`. So a frame's rows are the rows `gagpo sql "SELECT *
FROM <view>"` prints, by construction rather than by a second reader kept in step. Polars
pushes a frame's column selection and filters down to DuckDB, which reads only what they
need.

A reader is a snapshot: the files listed when it was opened. Open the store again to see
groups committed since; a compaction that has since merged away a file the snapshot names
makes a read of it fail, and opening again reads the store as it stands.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from gagpo.inspection.arguments import (
    DEFAULT_GAMMA,
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    check_gamma,
    check_store_root,
    timeout_problem,
)
from gagpo.schemas.errors import GagpoError, describe

if TYPE_CHECKING:
    import polars as pl


def open_store(
    url: str,
    as_of_update: int | None = None,
    *,
    gamma: float = DEFAULT_GAMMA,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_limit: str = "",
) -> StoreReader:
    """The store at `url` (a local folder or an fsspec URL such as s3://bucket/run) as
    Polars frames, read-only.

    `as_of_update`: the store as it stood after learner update U (`gagpo sql
    --as-of-update U`): the groups the learner's ledger records up to U, learner metrics
    and policy versions up to U. `gamma`: the discount of the `step_returns` and
    `state_pools` views. `timeout_s` (0: none) and `memory_limit` (a DuckDB size such as
    2GB; default half the machine's memory, at most 4 GiB) bound each `sql()` query, as
    `gagpo sql`'s --timeout and --memory-limit do. A missing store, a bad URL or value is
    a one-line GagpoError.
    """
    return StoreReader(
        url, as_of_update, gamma=gamma, timeout_s=timeout_s, memory_limit=memory_limit
    )


class StoreReader:
    """The views of `gagpo sql` over one store, as lazy Polars frames and SQL."""

    def __init__(
        self,
        url: str,
        as_of_update: int | None = None,
        *,
        gamma: float = DEFAULT_GAMMA,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_limit: str = "",
    ) -> None:
        from gagpo.inspection.sql import Limits, open_store_db

        _check_arguments(url, as_of_update, timeout_s, gamma)
        self.url = url
        self.as_of_update = as_of_update
        self.limits = Limits(timeout_s=float(timeout_s), memory_limit=memory_limit)
        self._lock = threading.Lock()  # sql(): one query at a time on the connection
        try:
            self._con = open_store_db(
                url, gamma=gamma, limits=self.limits, as_of_update=as_of_update
            )
        except GagpoError:
            raise
        except Exception as exc:  # a file system's own error (credentials, permissions)
            raise GagpoError(f"store {url!r} cannot be opened ({describe(exc)})") from None

    # --- the frames ---------------------------------------------------------------------
    def steps(self) -> pl.LazyFrame:
        """One row per agent turn (the steps table; `won_derived`: a schema 1.0 row)."""
        return self.view("steps")

    def advantages(self, tag: str | None = None) -> pl.LazyFrame:
        """One row per step under the advantage tag `tag` (`tags()`), or under every tag
        when None; the `estimator` column names the tag."""
        frame = self.view("advantages")
        if tag is None:
            return frame
        tags = self.tags()
        if tag not in tags:
            raise GagpoError(
                f"advantage tag {tag!r} is not in store {self.url!r}; accepted: "
                f"{', '.join(tags) or 'none (run gagpo advantages first)'}"
            )
        import polars as pl

        return frame.filter(pl.col("estimator") == tag)

    def groups(self) -> pl.LazyFrame:
        """One row per group: success rate, return spread, singleton states."""
        return self.view("groups")

    def trajectories(self) -> pl.LazyFrame:
        """One row per rollout: return, success (= won), length, policy version."""
        return self.view("trajectories")

    def learner_metrics(self) -> pl.LazyFrame:
        """One row per learner update (none before the learner runs)."""
        return self.view("learner_metrics")

    def view(self, name: str) -> pl.LazyFrame:
        """Any view of `gagpo sql` (docs/inspect.md) as a lazy frame: state_pools,
        policy_versions, step_returns, ... Each frame reads through a connection of its
        own, so frames can be joined and collected together."""
        from gagpo.inspection.sql import store_cursor
        from gagpo.inspection.sql_views import VIEWS

        if name not in VIEWS:
            raise GagpoError(f"no view {name!r}; accepted: {', '.join(VIEWS)}")
        return store_cursor(self._open()).sql(f"SELECT * FROM {name}").pl(lazy=True)

    def tags(self) -> list[str]:
        """The store's advantage tags (folders under advantages/)."""
        return self.sql("SELECT estimator FROM estimators ORDER BY estimator")[
            "estimator"
        ].to_list()

    # --- SQL ----------------------------------------------------------------------------
    def sql(self, query: str, params: list | dict | None = None) -> pl.DataFrame:
        """`query` in `gagpo sql`'s sandbox (read-only, confined to the store, bounded by
        the reader's limits), its last result as a DataFrame. `params` are the values of
        the query's `?` / `$name` placeholders, bound by DuckDB, never pasted as SQL."""
        import polars as pl

        from gagpo.inspection.sql import run_query

        con = self._open()
        with self._lock:
            return pl.from_arrow(run_query(con, query, self.limits, params))

    # --- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection and remove its spill folder; frames read no more."""
        from gagpo.inspection.sql import close_store_db

        con, self._con = self._con, None
        if con is not None:
            close_store_db(con)

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        as_of = f", as_of_update={self.as_of_update}" if self.as_of_update is not None else ""
        state = "" if self._con is not None else " (closed)"
        return f"StoreReader({self.url!r}{as_of}){state}"

    def _open(self):
        if self._con is None:
            raise GagpoError(
                f"the reader of store {self.url!r} is closed; accepted: gagpo.open_store again"
            )
        return self._con


def _check_arguments(url: object, as_of_update: object, timeout_s: object, gamma: object) -> None:
    """One line for a value `gagpo sql`'s options would refuse (click checks them there,
    against the same bounds: inspection/arguments.py)."""
    if not isinstance(url, str) or not url.strip():
        raise GagpoError(
            f"store URL {url!r} is not a path; accepted: a local path or an fsspec URL such "
            "as s3://bucket/prefix"
        )
    if as_of_update is not None and (
        isinstance(as_of_update, bool) or not isinstance(as_of_update, int) or as_of_update < 0
    ):
        raise GagpoError(
            f"as_of_update={as_of_update!r} is not an update; accepted: None or an integer ≥ 0"
        )
    if timeout_problem(timeout_s) is not None:
        raise GagpoError(
            f"timeout_s={timeout_s!r} is not a time limit; accepted: seconds in "
            f"[0, {MAX_TIMEOUT_S:g}] (0: none)"
        )
    check_gamma(gamma)
    check_store_root(url)

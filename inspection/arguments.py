"""What `gagpo sql` and `gagpo.open_store` both take, checked and defaulted in one place:
the store root, the query time limit and the discount.

Light to import (no DuckDB): the CLI's options use these bounds in `--help`, and the
library (inspection/library.py) checks a notebook's values against the same ones, so a
value is refused, or accepted, alike by both.
"""

from __future__ import annotations

import math

from gagpo.schemas.errors import GagpoError

DEFAULT_TIMEOUT_S = 300.0  # --timeout: seconds a query may run
VIEW_TIMEOUT_S = 60.0  # gagpo view: seconds a page's query (or its SQL box's) may run
# --gamma: the views' discount, the advantage stage's default (docs/design.md §4); used
# only where no advantages exist.
DEFAULT_GAMMA = 0.95
MAX_TIMEOUT_S = 1e7  # 115 days: longer is no limit, which 0 says


def timeout_problem(seconds: object) -> str | None:
    """Why `seconds` is not a query time limit, or None when it is one: a finite number in
    [0, MAX_TIMEOUT_S] (nan, inf and 1e300 are no limit a timer can keep; 0 is none)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return "is not a number of seconds"
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_TIMEOUT_S):
        return f"is not in the range 0<=x<={MAX_TIMEOUT_S:g}"
    return None


def check_gamma(gamma: object) -> float:
    """The discount `gamma` as a float: a number in [0, 1], not a bool (True would be read
    as 1); one GagpoError line otherwise."""
    if isinstance(gamma, bool) or not isinstance(gamma, int | float):
        raise GagpoError(f"gamma={gamma!r} is not a number; accepted: a number in [0, 1]")
    if not (math.isfinite(gamma) and 0.0 <= gamma <= 1.0):
        raise GagpoError(f"gamma={gamma!r} is out of range; accepted: a number in [0, 1]")
    return float(gamma)


def check_store_root(url: str) -> None:
    """One line for a local store root that exists but is no folder (`--store /dev/null`,
    a file): reading it would fail deep inside, on its policy/ or shards/ path. A missing
    root, or one on an object store, is left to the reader, which names it."""
    from gagpo.storage.store import Store

    store = Store(url)
    if store.is_local and store.fs.exists(store.root) and not store.fs.isdir(store.root):
        what = "a file" if store.fs.isfile(store.root) else "not a folder"  # /dev/null, a FIFO
        raise GagpoError(f"store {url!r} is {what}; accepted: a store root folder or URL")

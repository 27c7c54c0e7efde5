"""Bounded retries of store operations: the one place that decides what an outage is.

An object store (or an NFS mount) can vanish for seconds or minutes. Operations that
fail with a *transient* error (connection refused or reset, timeouts, HTTP 5xx, throttling)
are retried with exponential backoff, one log line per retry, until `bound_s` seconds have
passed since the first failure; then `StoreUnavailableError` (a user error: one line,
exit code 2) names the store, the operation and the last error. Everything else (a
missing file, a permission error, bad data) is not retried.

Backends are recognised by the names of their exception classes, so this module imports
neither botocore nor aiohttp (optional extras).
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from typing import TypeVar

from gagpo.schemas.errors import GagpoError, StoreUnavailableError, describe, is_transient

T = TypeVar("T")
log = logging.getLogger("gagpo.store")

DEFAULT_RETRY_S = 180.0  # long enough for a restart of an object-store endpoint
RETRY_ENV = "GAGPO_STORE_RETRY_S"  # overrides the default bound for every command
FIRST_DELAY_S, MAX_DELAY_S = 0.5, 30.0


def env_seconds(name: str, default: float, *, allow_zero: bool) -> float:
    """A duration in seconds from environment variable `name` (`default` when unset);
    anything else than a number >= 0 (> 0 unless `allow_zero`) is one clear error."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 if allow_zero else value > 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise GagpoError(f"{name}={raw!r}; accepted: seconds {bound}, e.g. {default:g}")
    return value


def default_bound_s() -> float:
    """The retry bound: $GAGPO_STORE_RETRY_S when set, else DEFAULT_RETRY_S."""
    return env_seconds(RETRY_ENV, DEFAULT_RETRY_S, allow_zero=True)


def retrying(
    action: Callable[[], T],
    what: str,
    *,
    bound_s: float,
    where: str = "store",
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run `action`; on a transient error retry with backoff 0.5 s, 1 s, 2 s, … (≤ 30 s,
    jittered) until `bound_s` seconds after the first failure, then raise
    StoreUnavailableError. Non-transient errors propagate at once."""
    first_failure = None
    attempt = 0
    while True:
        try:
            return action()
        except Exception as exc:
            if not is_transient(exc):
                raise
            now = time.monotonic()
            first_failure = first_failure if first_failure is not None else now
            waited = now - first_failure
            if waited >= bound_s:
                raise StoreUnavailableError(
                    f"{where} did not answer for {waited:.0f} s while {what} ({describe(exc)}); "
                    f"accepted: a reachable store (to wait longer than {bound_s:g} s, raise "
                    f"${RETRY_ENV}, or gagpo-actors --store-retry-seconds)"
                ) from None
            attempt += 1
            delay = min(FIRST_DELAY_S * 2 ** (attempt - 1), MAX_DELAY_S)
            delay = min(delay * random.uniform(0.5, 1.0), max(bound_s - waited, 0.0))
            log.warning(
                "%s: %s failed (%s); retry %d in %.1f s (giving up %.0f s after the first failure)",
                where,
                what,
                describe(exc),
                attempt,
                delay,
                bound_s,
            )
            sleep(delay)

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

import errno
import logging
import os
import random
import time
from collections.abc import Callable
from typing import TypeVar

from gagpo.schemas.errors import GagpoError

T = TypeVar("T")
log = logging.getLogger("gagpo.store")

DEFAULT_RETRY_S = 180.0  # long enough for a restart of an object-store endpoint
RETRY_ENV = "GAGPO_STORE_RETRY_S"  # overrides the default bound for every command
FIRST_DELAY_S, MAX_DELAY_S = 0.5, 30.0

_NETWORK_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EPIPE,
    errno.ESTALE,
    errno.EAGAIN,
}
# Exception classes of botocore, aiohttp, urllib3 and requests that mean "no answer".
_TRANSIENT_NAMES = {
    "ConnectionError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "HTTPClientError",
    "ProxyConnectionError",
    "ClientConnectionError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "ClientPayloadError",
    "ClientOSError",
    "IncompleteRead",
    "ResponseStreamingError",
    "FSTimeoutError",
    "ProtocolError",
    "NewConnectionError",
}
# Error codes of S3-style services that ask the client to come back later.
_TRANSIENT_CODES = (
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestTimeTooSkewed",
    "503",
    "500",
    "502",
    "504",
)
_PERMANENT = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)


class StoreUnavailableError(GagpoError):
    """The store did not answer within the retry bound."""


class StoreFullError(GagpoError):
    """The store's disk (or quota) is full: ENOSPC or EDQUOT. Retrying would not help."""


_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_MISSING_BUCKET = ("NoSuchBucket", "bucket does not exist")


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is ENOSPC or EDQUOT; also
    `shutil.Error`, which carries the errors of a folder copy as text only."""
    texts = tuple(f"[Errno {n}]" for n in _FULL_ERRNOS)
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if isinstance(e, OSError) and e.errno is None and any(t in str(e) for t in texts):
            return True
    return False


def is_missing_bucket(exc: BaseException) -> bool:
    """Whether `exc` says that the object store's bucket itself does not exist (it vanished,
    or was never made): s3fs raises it as a FileNotFoundError, like a missing key."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code == "NoSuchBucket" or any(text in str(e) for text in _MISSING_BUCKET):
            return True
    return False


def _chain(exc: BaseException | None, limit: int = 8):
    """`exc` and the exceptions it was raised from (cause, else context), at most `limit`."""
    seen = 0
    while exc is not None and seen < limit:
        yield exc
        context = None if exc.__suppress_context__ else exc.__context__
        exc, seen = exc.__cause__ or context, seen + 1


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


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) says the store did not answer."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (GagpoError, *_PERMANENT)):  # ours: already judged, or bad data
            return False
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS:
            return True
        if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__):
            return True
        if _transient_service_error(exc):
            return True
        context = None if exc.__suppress_context__ else exc.__context__
        exc, seen = exc.__cause__ or context, seen + 1
    return False


def _transient_service_error(exc: BaseException) -> bool:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = str(response.get("Error", {}).get("Code", ""))
        return (isinstance(status, int) and status >= 500) or code in _TRANSIENT_CODES
    # s3fs turns unknown service errors into a bare OSError carrying the code in its text.
    if type(exc) is OSError and exc.errno is None:
        text = str(exc)
        return any(code in text for code in _TRANSIENT_CODES if not code.isdigit())
    return False


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (its class name when it has none): the one
    way every error is summarised in one line."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def describe(exc: BaseException) -> str:
    """`ExceptionName: first line of its message`, short enough for one log line."""
    text = first_line(exc, 200)
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


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

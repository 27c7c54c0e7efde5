"""Errors that are the user's to fix (bad config, bad input, unreachable store), and what
an exception means: transient (the store did not answer), a full disk, or neither.

CLIs print user errors as one line and exit non-zero, without a traceback. Backends are
recognised by the names of their exception classes, so this module imports neither
botocore nor aiohttp (optional extras); storage/retry.py retries what is transient.
"""

from __future__ import annotations

import errno


class GagpoError(Exception):
    """A problem the user can fix; the message names it and what is accepted."""


class ValidationError(GagpoError):
    """Data that breaks the column contract; the message names the reason."""


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

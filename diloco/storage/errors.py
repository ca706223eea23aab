"""Storage errors: the one vocabulary backend failures are translated into, and the table that does it.

Contract: callers catch these, never botocore/OSError details. Transient is retried (bounded);
the rest never are. Programming errors (TypeError, ...) are never translated.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

try:  # botocore comes with s3fs; the store still works for file:// and memory:// without it
    from botocore.exceptions import BotoCoreError, ClientError
except ImportError:  # a file:// or memory:// store on a machine without s3fs: no botocore error can occur,
    # so the names are classes nothing raises (OSError here would turn every missing file into a StorageError)
    class BotoCoreError(Exception):  # type: ignore[no-redef]
        """Stands in for botocore's: never raised."""

    class ClientError(Exception):  # type: ignore[no-redef]
        """Stands in for botocore's: never raised."""

T = TypeVar("T")
log = logging.getLogger("diloco.storage")
BACKOFF_BASE_S = 0.05  # first retry waits ~50 ms ...
BACKOFF_CAP_S = 2.0  # ... doubling, never more than 2 s per wait
# A request is retried for at most this long after its first failure (an endpoint that is down fails within
# about this, not after minutes of silent retries); DILOCO_STORAGE_RETRY_WINDOW_S sets another default.
RETRY_WINDOW_S = 10.0
RETRY_WINDOW_ENV = "DILOCO_STORAGE_RETRY_WINDOW_S"


class StorageError(Exception):
    """Base class of every storage failure."""


class NotFound(StorageError, KeyError):
    """The object does not exist."""


class Conflict(StorageError):
    """An exclusive create lost: the object already exists (HTTP 412 / 409, EEXIST)."""


class TransientError(StorageError):
    """Worth retrying: throttling, 5xx, timeouts, connection resets."""


class PermissionDenied(StorageError):
    """Credentials are missing or not allowed (HTTP 401/403). Never retried."""


class BadRequest(StorageError):
    """The request itself is wrong (bad key, bad bucket, HTTP 400). Never retried."""


# ---------------------------------------------------------------- error translation (the table)

_CODES: dict[type[StorageError], tuple[str, ...]] = {  # S3 error codes, checked before HTTP status
    NotFound: ("NoSuchKey", "NotFound"),
    Conflict: ("PreconditionFailed", "ConditionalRequestConflict"),
    PermissionDenied: ("AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                       "ExpiredToken", "InvalidToken", "RequestTimeTooSkewed"),
    TransientError: ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                     "TooManyRequestsException", "ServiceUnavailable", "InternalError", "RequestTimeout",
                     "OperationAborted"),
    # a missing bucket is a configuration error, not a missing object
    BadRequest: ("NoSuchBucket", "InvalidBucketName", "InvalidArgument", "InvalidRequest", "KeyTooLongError",
                 "EntityTooLarge"),
}
_CODE_TO_ERROR = {code: kind for kind, codes in _CODES.items() for code in codes}
_TRANSIENT_ERRNOS = {
    errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
    errno.ECONNABORTED, errno.EPIPE, errno.EINTR, errno.EIO, errno.EREMOTEIO,
}
_BAD_REQUEST_ERRNOS = {errno.EINVAL, errno.ENAMETOOLONG}


def _error_for_status(status: int) -> type[StorageError]:
    if status in (409, 412):
        return Conflict
    if status == 404:
        return NotFound
    if status in (401, 403):
        return PermissionDenied
    if status in (408, 429) or status >= 500:
        return TransientError
    if 400 <= status < 500:
        return BadRequest
    return StorageError


def _client_error_in(exc: BaseException) -> Any | None:
    """The botocore ClientError behind exc (s3fs wraps it in an OSError as __cause__), if any."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, ClientError) and isinstance(getattr(seen, "response", None), dict):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _error_for_client(client_error: Any) -> type[StorageError]:
    response = client_error.response
    code = str(response.get("Error", {}).get("Code", ""))
    if code in _CODE_TO_ERROR:
        return _CODE_TO_ERROR[code]
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code.isdigit():
        status = int(code)
    return _error_for_status(int(status)) if status else StorageError


def _error_for_oserror(exc: OSError, writing: bool) -> type[StorageError]:
    if isinstance(exc, FileExistsError) or exc.errno == errno.EEXIST:
        return Conflict
    if isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOENT:
        return NotFound
    if isinstance(exc, IsADirectoryError | NotADirectoryError):
        return BadRequest if writing else NotFound  # the key collides with a folder of keys
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied
    if isinstance(exc, TimeoutError | ConnectionError) or exc.errno in _TRANSIENT_ERRNOS:
        return TransientError
    if exc.errno in _BAD_REQUEST_ERRNOS:
        return BadRequest
    return StorageError


def _error_for_botocore(exc: BaseException) -> type[StorageError]:
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return PermissionDenied
    if name in ("ParamValidationError", "InvalidS3AddressingStyleError"):
        return BadRequest
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"ConnectionError", "HTTPClientError", "ReadTimeoutError", "ConnectTimeoutError"}:
        return TransientError
    return StorageError


def translate_error(exc: BaseException, *, key: str = "", writing: bool = False) -> StorageError:
    """The one place a backend failure becomes a StorageError; the original is kept as __cause__."""
    if isinstance(exc, StorageError):
        return exc
    client_error = _client_error_in(exc)
    if client_error is not None:
        kind = _error_for_client(client_error)
    elif isinstance(exc, BotoCoreError):  # before OSError: some botocore errors are also IOErrors
        kind = _error_for_botocore(exc)
    elif isinstance(exc, OSError):
        kind = _error_for_oserror(exc, writing)
    else:
        kind = StorageError
    err = kind(f"{key!r}: {type(exc).__name__}: {exc}" if key else f"{type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


class Backoff:
    """Exponential back-off, the one helper every retry loop of the project uses: waits of first_s, doubled
    per attempt, capped at cap_s; with `jitter`, each wait is spread over [w/2, w] ("equal jitter"), so
    many processes retrying at once do not stay in step. `reset()` after a success."""

    def __init__(self, first_s: float, cap_s: float, *, jitter: bool = False) -> None:
        if first_s < 0 or cap_s < first_s:
            raise ValueError(f"back-off needs 0 <= first_s <= cap_s, got {first_s}, {cap_s}")
        self.first_s, self.cap_s, self.jitter = first_s, cap_s, jitter
        self.attempts = 0  # waits handed out since the last reset

    def wait_for(self, attempt: int) -> float:
        """The wait before retry number attempt+1 (no state change)."""
        wait_s = min(self.cap_s, self.first_s * 2 ** min(attempt, 62))
        return wait_s / 2 + random.uniform(0, wait_s / 2) if self.jitter else wait_s

    def next_s(self) -> float:
        """The next wait; counts an attempt."""
        wait_s = self.wait_for(self.attempts)
        self.attempts += 1
        return wait_s

    def reset(self) -> None:
        self.attempts = 0


_REQUEST_BACKOFF = Backoff(BACKOFF_BASE_S, BACKOFF_CAP_S, jitter=True)


def backoff_s(attempt: int) -> float:
    """Jittered exponential backoff before retry number attempt+1 of a storage request (equal jitter,
    capped)."""
    return _REQUEST_BACKOFF.wait_for(attempt)


def default_retry_window_s() -> float:
    """The retry window of a store opened without one: $DILOCO_STORAGE_RETRY_WINDOW_S, else RETRY_WINDOW_S."""
    raw = os.environ.get(RETRY_WINDOW_ENV, "")
    if not raw:
        return RETRY_WINDOW_S
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"{RETRY_WINDOW_ENV}={raw!r} must be a number of seconds") from None
    if value < 0:
        raise BadRequest(f"{RETRY_WINDOW_ENV}={raw!r} must be >= 0")
    return value


def call_with_retries(
    fn: Callable[[], T],
    *,
    max_retries: int,
    key: str = "",
    writing: bool = False,
    sleep: Callable[[float], None] = time.sleep,
    window_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """fn(), retried only on TransientError: at most max_retries times and, with window_s, only while the
    retry (its wait plus as long as the last attempt took) would end within window_s of the first attempt;
    one retry is always made. Every error is translated; each retry is logged at once (WARNING: the attempt,
    the wait), so an unreachable endpoint is never silent."""
    started = clock()
    for attempt in range(max_retries + 1):
        tried = clock()
        try:
            return fn()
        except (OSError, BotoCoreError, ClientError, StorageError) as exc:
            err = translate_error(exc, key=key, writing=writing)
            if err is exc and not isinstance(err, TransientError):
                raise
            if not isinstance(err, TransientError) or attempt == max_retries:
                raise err from exc
            now, wait_s = clock(), backoff_s(attempt)
            if window_s is not None and attempt > 0 and now + wait_s + (now - tried) - started > window_s:
                raise type(err)(f"{err} (gave up after {attempt + 1} attempts in {now - started:.1f} s: "
                                f"retry window {window_s:g} s, {RETRY_WINDOW_ENV})") from exc
            log.warning("storage: %s; retrying (attempt %d of %d, next in %.1f s)", err, attempt + 2,
                        max_retries + 1, wait_s)
        sleep(wait_s)
    raise AssertionError("unreachable")  # pragma: no cover

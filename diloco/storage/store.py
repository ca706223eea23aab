"""One object-store interface over fsspec for any URL: file://, memory://, s3://bucket/prefix, gs://...

Contract: keys are '/'-separated relative paths under the store root; listings are never served
from a cache; put_if_absent is a true atomic exclusive create; errors are translated in one place.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import fsspec

from diloco.storage.errors import (
    BadRequest,
    Conflict,
    NotFound,
    PermissionDenied,
    StorageError,
    TransientError,
)

try:  # botocore comes with s3fs; the store still works for file:// and memory:// without it
    from botocore.exceptions import BotoCoreError, ClientError
except ImportError:  # pragma: no cover - s3fs is a hard dependency of the project
    BotoCoreError = ClientError = OSError  # type: ignore[assignment,misc]

T = TypeVar("T")

TMP_PREFIX = ".diloco-tmp-"  # local temp files; hidden from list(), reserved in keys
MAX_KEY_BYTES = 1024  # the S3 limit; enforced everywhere so every backend accepts the same keys
BACKOFF_BASE_S = 0.05  # first retry waits ~50 ms ...
BACKOFF_CAP_S = 2.0  # ... doubling, never more than 2 s per wait
_BACKEND_ERRORS: tuple[type[BaseException], ...] = (OSError, BotoCoreError, ClientError)
_MEMORY_LOCK = threading.Lock()  # memory:// is one dict per process; this makes create atomic in it
_ATOMIC_CREATE_PROTOCOLS = {"s3", "s3a"}  # server-side If-None-Match: * via s3fs mode="create"

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


def backoff_s(attempt: int) -> float:
    """Jittered exponential backoff before retry number attempt+1 (equal jitter, capped)."""
    wait_s = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt)
    return wait_s / 2 + random.uniform(0, wait_s / 2)


def call_with_retries(
    fn: Callable[[], T],
    *,
    max_retries: int,
    key: str = "",
    writing: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """fn(), retried only on TransientError (at most max_retries times); every error translated."""
    for attempt in range(max_retries + 1):
        try:
            return fn()
        except _BACKEND_ERRORS + (StorageError,) as exc:
            err = translate_error(exc, key=key, writing=writing)
            if err is exc and not isinstance(err, TransientError):
                raise
            if not isinstance(err, TransientError) or attempt == max_retries:
                raise err from exc
        sleep(backoff_s(attempt))
    raise AssertionError("unreachable")  # pragma: no cover


# ---------------------------------------------------------------- keys


def check_key(key: str) -> str:
    """A valid object key or BadRequest: relative, '/'-separated, no empty/'.'/'..' segments."""
    if not isinstance(key, str) or not key:
        raise BadRequest(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key:
        raise BadRequest(f"object key {key!r} must be relative and use '/' separators")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in key):
        raise BadRequest(f"object key {key!r} contains control characters")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise BadRequest(f"object key {key[:40]!r}... is longer than {MAX_KEY_BYTES} bytes")
    for segment in key.split("/"):
        if segment in ("", ".", "..") or segment.startswith(TMP_PREFIX):
            raise BadRequest(f"object key {key!r} has an invalid segment {segment!r}")
    return key


def check_prefix(prefix: str) -> str:
    """A valid listing prefix: '' (everything) or a key-like string, optionally ending in '/'."""
    if prefix == "":
        return prefix
    check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


# ---------------------------------------------------------------- backends


class _Backend(Protocol):
    def read(self, key: str) -> bytes: ...
    def size(self, key: str) -> int: ...
    def write(self, key: str, data: bytes) -> None: ...
    def create(self, key: str, data: bytes) -> None: ...
    def walk(self, folder: str) -> list[str]: ...  # every key under folder ('' = all), any order
    def remove(self, key: str) -> None: ...


class _LocalBackend:
    """A folder on a local disk: temp file + os.replace for put, temp file + os.link for create."""

    def __init__(self, root: str) -> None:
        self.root = root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def read(self, key: str) -> bytes:
        with open(self._path(key), "rb") as f:
            return f.read()

    def size(self, key: str) -> int:
        path = self._path(key)
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, "not an object", path)
        return info.st_size

    def _write_temp(self, path: str, data: bytes) -> str:
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, TMP_PREFIX + secrets.token_hex(8))
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are durable before the name becomes visible
        return tmp

    def write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def create(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)  # atomic; EEXIST if anyone else got there first
        finally:
            _unlink_quietly(tmp)

    def walk(self, folder: str) -> list[str]:
        top = self._path(folder) if folder else self.root
        keys = []
        for dirpath, _dirs, files in os.walk(top):  # tolerates entries vanishing mid-walk
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            keys.extend(name if rel == "." else f"{rel}/{name}" for name in files)
        return keys

    def remove(self, key: str) -> None:
        os.unlink(self._path(key))


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class _FsspecBackend:
    """Any fsspec filesystem (s3fs, memory, gcsfs...) rooted at a path inside it."""

    def __init__(self, fs: Any, root: str, protocol: str) -> None:
        self.fs, self.root, self.protocol = fs, root.rstrip("/"), protocol

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def read(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(self._path(key)))

    def size(self, key: str) -> int:
        info = self.fs.info(self._path(key))
        if info.get("type") != "file":
            raise FileNotFoundError(errno.ENOENT, "not an object", key)
        return int(info["size"])

    def write(self, key: str, data: bytes) -> None:
        if self.protocol == "memory":
            with _MEMORY_LOCK:
                self.fs.pipe_file(self._path(key), data)
        else:
            self.fs.pipe_file(self._path(key), data)

    def create(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if self.protocol in _ATOMIC_CREATE_PROTOCOLS:
            self.fs.pipe_file(path, data, mode="create")  # PUT with If-None-Match: *
        elif self.protocol == "memory":
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    raise FileExistsError(errno.EEXIST, "object exists", key)
                self.fs.pipe_file(path, data)
        else:
            raise BadRequest(
                f"no atomic exclusive create is known for {self.protocol}:// — commits need "
                "s3://, file:// or memory://"
            )

    def walk(self, folder: str) -> list[str]:
        top = self._path(folder) if folder else self.root
        root = self.root.lstrip("/")
        keys = []
        for found in self.fs.find(top):
            path = str(found).lstrip("/")
            if not root:
                keys.append(path)
            elif path.startswith(root + "/"):
                keys.append(path[len(root) + 1 :])
        return keys

    def remove(self, key: str) -> None:
        self.fs.rm_file(self._path(key))


# ---------------------------------------------------------------- the store


def _s3_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    options = dict(storage_options)
    client_kwargs = options.get("client_kwargs") or {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_url" not in options and "endpoint_url" not in client_kwargs:
        options["endpoint_url"] = endpoint
    options["use_listings_cache"] = False  # listings must never come from a cache (DESIGN §3)
    options["skip_instance_cache"] = True
    return options


def _open_backend(url: str, storage_options: dict[str, Any]) -> tuple[str, _Backend]:
    """(normalised url, backend) for a URL; a bare path or file://relative is relative to cwd."""
    if "://" not in url or url.startswith(("file://", "local://")):
        path = url.split("://", 1)[1] if "://" in url else url
        if not path:
            raise BadRequest(f"storage url {url!r} names no folder")
        root = os.path.abspath(os.path.expanduser(path))
        return f"file://{root}", _LocalBackend(root)
    protocol = url.split("://", 1)[0].lower()
    options = _s3_options(storage_options) if protocol in ("s3", "s3a") else storage_options
    try:
        fs, root = fsspec.url_to_fs(url, **options)
    except (ValueError, ImportError) as exc:
        raise BadRequest(f"cannot open storage url {url!r}: {exc}") from exc
    if protocol in ("s3", "s3a") and not root.strip("/"):
        raise BadRequest(f"storage url {url!r} names no bucket")
    return url.rstrip("/"), _FsspecBackend(fs, root, protocol)


class ObjectStore:
    """A bucket (or folder) addressed by URL. Thread-safe; one instance per process is enough."""

    url: str

    def __init__(self, url: str, *, storage_options: dict | None = None, max_retries: int = 5) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.max_retries = max_retries
        self.url, self._backend = _open_backend(url, dict(storage_options or {}))

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def _call(self, fn: Callable[[], T], key: str, *, writing: bool = False) -> T:
        return call_with_retries(fn, max_retries=self.max_retries, key=key, writing=writing)

    def get(self, key: str) -> bytes:
        """The object's bytes. NotFound if absent."""
        check_key(key)
        return self._call(lambda: self._backend.read(key), key)

    def get_size(self, key: str) -> int:
        """The object's size in bytes without reading it. NotFound if absent."""
        check_key(key)
        return self._call(lambda: self._backend.size(key), key)

    def put(self, key: str, data: bytes) -> None:
        """Write (or overwrite) an object; atomic for readers (they see old or new, never a part)."""
        check_key(key)
        payload = bytes(data)
        self._call(lambda: self._backend.write(key, payload), key, writing=True)

    def put_if_absent(self, key: str, data: bytes) -> None:
        """Exclusive create. Conflict if the key exists — exactly one of N racing writers wins.

        Idempotent for identical bytes: if the object already holds exactly `data` (our own earlier
        attempt landed but its reply was lost and the retry saw 412), this returns normally.
        """
        check_key(key)
        payload = bytes(data)
        try:
            self._call(lambda: self._backend.create(key, payload), key, writing=True)
        except Conflict:
            if self._holds(key, payload):
                return
            raise

    def _holds(self, key: str, payload: bytes) -> bool:
        try:
            return self.get_size(key) == len(payload) and self.get(key) == payload
        except NotFound:
            return False

    def exists(self, key: str) -> bool:
        """Whether an object is at key (a 'folder' of keys is not an object)."""
        try:
            self.get_size(key)
        except NotFound:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        """All keys under prefix (recursively), sorted, relative to the store root. Never cached."""
        check_prefix(prefix)
        folder = prefix.rpartition("/")[0]
        found = self._call(lambda: self._backend.walk(folder), prefix)
        return sorted(
            key
            for key in found
            if key.startswith(prefix) and not any(s.startswith(TMP_PREFIX) for s in key.split("/"))
        )

    def delete(self, key: str) -> None:
        """Remove an object; absent is not an error."""
        check_key(key)
        with contextlib.suppress(NotFound):
            self._call(lambda: self._backend.remove(key), key, writing=True)

    def iter_list(self, prefix: str) -> Iterator[str]:
        yield from self.list(prefix)


def open_store(url: str, **storage_options: object) -> ObjectStore:
    """The store for a URL; a bare path means file://. s3 honours AWS_ENDPOINT_URL and AWS_* vars."""
    return ObjectStore(url, storage_options=dict(storage_options))

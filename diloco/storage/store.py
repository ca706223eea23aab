"""One object-store interface over fsspec for any URL: file://, memory://, s3://bucket/prefix, gs://...

Contract: keys are '/'-separated relative paths under the store root; listings are never served
from a cache; put_if_absent is a true atomic exclusive create; errors are translated in one place.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import errno
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import fsspec

from diloco.storage.errors import (
    BadRequest,
    Conflict,
    NotFound,
    backoff_s,
    call_with_retries,
    translate_error,
)

T = TypeVar("T")
__all__ = ["ObjectStore", "backoff_s", "call_with_retries", "check_key", "check_prefix", "open_store",
           "translate_error"]

TMP_PREFIX = ".diloco-tmp-"  # local temp files; hidden from list(), reserved in keys
MAX_KEY_BYTES = 1024  # the S3 limit; enforced everywhere so every backend accepts the same keys
_MEMORY_LOCK = threading.Lock()  # memory:// is one dict per process; this makes create atomic in it
_ATOMIC_CREATE_PROTOCOLS = {"s3", "s3a"}  # server-side If-None-Match: * via s3fs mode="create"

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
    def modified(self, key: str) -> float: ...  # unix seconds of the last write
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

    def modified(self, key: str) -> float:
        return os.stat(self._path(key)).st_mtime

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

    def modified(self, key: str) -> float:
        stamp = self.fs.modified(self._path(key))
        if stamp.tzinfo is None:  # fsspec's memory filesystem stamps naive UTC
            stamp = stamp.replace(tzinfo=datetime.UTC)
        return stamp.timestamp()

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

    def with_retries(self, max_retries: int) -> ObjectStore:
        """This store (the same backend, and faults when it is a FaultyStore) with another retry budget:
        e.g. 1 for a probe or heartbeat that is simply tried again later, so a storage outage does not
        hold up the training loop for the full back-off on every call."""
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        clone = copy.copy(self)
        clone.max_retries = max_retries
        return clone

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

    def modified(self, key: str) -> float:
        """Unix time of the object's last write. NotFound if absent."""
        check_key(key)
        return self._call(lambda: self._backend.modified(key), key)

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

"""The Store interface, and ObjectStore: one implementation for the URLs a run can live at (file://,
memory://, s3://bucket/prefix; other protocols are refused: a run needs an atomic exclusive create).

Contract: keys are '/'-separated relative paths under the store root; listings are never served
from a cache; put_if_absent is a true atomic exclusive create; errors are translated in one place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol, TypeVar

from diloco.storage.backends import TMP_PREFIX, Backend, open_backend
from diloco.storage.errors import BadRequest, Conflict, NotFound, call_with_retries, default_retry_window_s

T = TypeVar("T")
__all__ = ["MAX_KEY_BYTES", "ObjectStore", "Store", "check_key", "check_prefix", "open_store"]

MAX_KEY_BYTES = 1024  # the S3 limit; enforced everywhere so every backend accepts the same keys


class Store(Protocol):
    """What every part of the project may ask of the bucket: ObjectStore, and the wrappers over it
    (diloco.storage.wrapper). Every error is a diloco.storage.errors.StorageError; bad keys are
    BadRequest before any I/O; transient failures are retried at most max_retries times."""

    @property
    def url(self) -> str: ...
    @property
    def max_retries(self) -> int: ...
    def with_retries(self, max_retries: int) -> Store: ...
    def get(self, key: str) -> bytes: ...
    def get_size(self, key: str) -> int: ...
    def modified(self, key: str) -> float: ...
    def put(self, key: str, data: bytes) -> None: ...
    def put_if_absent(self, key: str, data: bytes) -> None: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str, after: str = "") -> list[str]: ...
    def folders(self, prefix: str) -> list[str]: ...
    def sizes(self, prefix: str) -> dict[str, int]: ...
    def delete(self, key: str) -> None: ...


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


# ---------------------------------------------------------------- the store


class ObjectStore:
    """A bucket (or folder) addressed by URL. Thread-safe; one instance per process is enough."""

    url: str

    def __init__(self, url: str, *, storage_options: dict | None = None, max_retries: int = 5,
                 backend: Backend | None = None, retry_window_s: float | None = None) -> None:
        """`backend`: an open one to share (with_retries; then `url` is already normalised). A request is
        retried at most max_retries times and not after retry_window_s since its first failure (default:
        $DILOCO_STORAGE_RETRY_WINDOW_S, else 10 s)."""
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.max_retries = max_retries
        self.retry_window_s = default_retry_window_s() if retry_window_s is None else retry_window_s
        if backend is None:
            self.url, self._backend = open_backend(url, dict(storage_options or {}))
        else:
            self.url, self._backend = url, backend

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def with_retries(self, max_retries: int) -> ObjectStore:
        """This store (the same backend) with another retry budget:
        e.g. 1 for a probe or heartbeat that is simply tried again later, so a storage outage does not
        hold up the training loop for the full back-off on every call."""
        return ObjectStore(self.url, max_retries=max_retries, backend=self._backend,
                           retry_window_s=self.retry_window_s)

    def _call(self, fn: Callable[[], T], key: str, *, writing: bool = False) -> T:
        return call_with_retries(fn, max_retries=self.max_retries, key=key, writing=writing,
                                 window_s=self.retry_window_s)

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
        """Write (or overwrite) an object; atomic for readers (they see old or new, never a part). A bytearray
        is written as it is, not copied: the caller must not change it meanwhile."""
        check_key(key)
        payload = data if isinstance(data, bytearray) else bytes(data)
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

    def list(self, prefix: str, after: str = "") -> list[str]:
        """All keys under prefix (recursively), sorted, relative to the store root. Never cached. With `after`
        (a key under prefix), only the keys sorting after it: on S3 one listing from there (StartAfter), so a
        reader that keeps its place pays for what is new, not for everything under prefix."""
        check_prefix(prefix)
        if after:
            check_key(after)
            if not after.startswith(prefix):
                raise BadRequest(f"list after {after!r}: not a key under {prefix!r}")
        folder = prefix.rpartition("/")[0]
        found = self._call(lambda: self._backend.walk(folder, after), prefix)
        return sorted(
            key
            for key in found
            if key.startswith(prefix) and key > after
            and not any(s.startswith(TMP_PREFIX) for s in key.split("/"))
        )

    def folders(self, prefix: str) -> list[str]:
        """The names of the folders directly under prefix (a prefix ending in '/', or '' for the store root),
        sorted: one listing with a delimiter on S3, O(folders) however many keys they hold. Never cached."""
        check_prefix(prefix)
        if prefix and not prefix.endswith("/"):
            raise BadRequest(f"folders of {prefix!r}: a folder prefix ends in '/'")
        found = self._call(lambda: self._backend.folders(prefix.rstrip("/")), prefix)
        return sorted(name for name in found if name and not name.startswith(TMP_PREFIX))

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every key under prefix (recursively) with its size in bytes, from one listing (S3's ListObjectsV2
        carries the sizes: no HEAD per object). Never cached."""
        check_prefix(prefix)
        folder = prefix.rpartition("/")[0]
        found = self._call(lambda: self._backend.walk_sizes(folder), prefix)
        return {key: size for key, size in sorted(found.items())
                if key.startswith(prefix) and not any(s.startswith(TMP_PREFIX) for s in key.split("/"))}

    def delete(self, key: str) -> None:
        """Remove an object; absent is not an error."""
        check_key(key)
        with contextlib.suppress(NotFound):
            self._call(lambda: self._backend.remove(key), key, writing=True)


def open_store(url: str, **storage_options: object) -> ObjectStore:
    """The store for a URL; a bare path means file://. s3 honours AWS_ENDPOINT_URL and AWS_* vars."""
    return ObjectStore(url, storage_options=dict(storage_options))

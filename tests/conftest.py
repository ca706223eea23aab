"""Shared fixtures: a real S3 server (moto on an ephemeral port, or DILOCO_TEST_S3_ENDPOINT) and stores.

Run against MinIO instead of moto:
    DILOCO_TEST_S3_ENDPOINT=http://127.0.0.1:9000 AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... make test
(optionally DILOCO_TEST_S3_BUCKET=<existing bucket>; each test then gets its own prefix in it).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from diloco.bench._s3_server import CREDENTIALS as MOTO_CREDENTIALS
from diloco.bench._s3_server import moto_server

# tests/browser and tests/deployment share one Prefect server, its workers and a training run per session
# (tests/deployment/prefect_stack.py): under xdist (`make test`: two workers) they run on one worker, in order
PREFECT_STACK_TESTS = ("tests/browser/", "tests/deployment/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Every other test is scheduled alone (as `--dist load`); the Prefect-stack tests as one unit, so the
    stack starts once and the test that stops its run ends its training. (xdist's own `loadgroup` does not
    group under pytest 9, whose node ids it can no longer rewrite.)"""
    from xdist.scheduler import LoadScopeScheduling

    class PrefectStackTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "prefect-stack" if nodeid.startswith(PREFECT_STACK_TESTS) else nodeid

    return PrefectStackTogether(config, log)


@pytest.fixture(autouse=True, scope="session")
def _learner_local_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Learners' local state (DILOCO_LOCAL_DIR) goes to a temp dir for the session, not .diloco/ in the
    checkout; processes the tests start inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DILOCO_LOCAL_DIR", str(tmp_path_factory.mktemp("learner-local")))
        yield


def _s3_credentials() -> dict[str, str]:
    """Fake credentials for moto; the caller's own for a real endpoint."""
    if not os.environ.get("DILOCO_TEST_S3_ENDPOINT"):
        return dict(MOTO_CREDENTIALS)
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
    return {name: os.environ[name] for name in names if os.environ.get(name)}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL of an S3 server for this session: moto on 127.0.0.1:<free port>, or the real one."""
    endpoint = os.environ.get("DILOCO_TEST_S3_ENDPOINT")
    if endpoint:
        yield endpoint
        return
    # a process of its own (not a thread beside the tests: the second core), keeping connections open
    with moto_server("127.0.0.1") as (url, _):
        yield url


def _ensure_bucket(endpoint: str, bucket: str, credentials: dict[str, str]) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",  # only for this bootstrap client; the store itself passes no region
        aws_access_key_id=credentials.get("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=credentials.get("AWS_SECRET_ACCESS_KEY"),
        aws_session_token=credentials.get("AWS_SESSION_TOKEN"),
    )
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)


@pytest.fixture
def s3_url(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """`s3://<bucket>/<prefix>`, fresh per test, with AWS_ENDPOINT_URL and credentials in os.environ
    (so `open_store(url)` alone works, here and in subprocesses)."""
    credentials = _s3_credentials()
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    bucket = os.environ.get("DILOCO_TEST_S3_BUCKET") or f"diloco-test-{uuid.uuid4().hex[:12]}"
    _ensure_bucket(s3_server, bucket, credentials)
    return f"s3://{bucket}/t-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["memory", "file", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request: pytest.FixtureRequest, tmp_path: os.PathLike) -> Iterator[str]:
    """A fresh, empty store URL on each backend: memory://, file://<tmp_path>, s3://."""
    if request.param == "s3":
        yield request.getfixturevalue("s3_url")
    elif request.param == "file":
        yield f"file://{tmp_path}/store"
    else:
        import fsspec

        name = f"diloco-test-{uuid.uuid4().hex[:12]}"
        yield f"memory://{name}"
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)

"""The storage error vocabulary (storage/errors.py): the translation table and the retry loop, fed real
exception objects (botocore ClientError, the OSError s3fs wraps it in, OSError, botocore connection
errors), and the one back-off helper.
Run: `.venv/bin/pytest tests/unit/test_storage_errors.py`.
"""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, ReadTimeoutError
from s3fs.errors import translate_boto_error

from diloco.storage import BadRequest, Conflict, NotFound, PermissionDenied, StorageError, TransientError
from diloco.storage.errors import Backoff, backoff_s, call_with_retries, translate_error

# ---------------------------------------------------------------- the translation table


def _client_error(code: str, status: int, condition: str = "") -> ClientError:
    error = {"Code": code, "Message": f"{code} happened"}
    if condition:
        error["Condition"] = condition
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


@pytest.mark.parametrize(
    "code, status, kind",
    [
        ("SlowDown", 503, TransientError),
        ("ServiceUnavailable", 503, TransientError),
        ("InternalError", 500, TransientError),
        ("502", 502, TransientError),
        ("ThrottlingException", 400, TransientError),
        ("TooManyRequests", 429, TransientError),
        ("PreconditionFailed", 412, Conflict),
        ("ConditionalRequestConflict", 409, Conflict),
        ("AccessDenied", 403, PermissionDenied),
        ("Unauthorized", 401, PermissionDenied),
        ("InvalidAccessKeyId", 403, PermissionDenied),
        ("InvalidArgument", 400, BadRequest),
        ("SomethingNew", 400, BadRequest),
        ("NoSuchKey", 404, NotFound),
        ("NoSuchBucket", 404, BadRequest),
    ],
)
def test_client_errors_translate(code: str, status: int, kind: type[StorageError]) -> None:
    raw = _client_error(code, status, condition="If-None-Match" if status == 412 else "")
    wrapped = translate_boto_error(raw)  # what s3fs actually raises: an OSError with the cause attached
    for exc in (raw, wrapped):
        err = translate_error(exc, key="k")
        assert type(err) is kind, (exc, err)
        assert err.__cause__ is exc


@pytest.mark.parametrize(
    "exc, kind",
    [
        (FileExistsError(errno.EEXIST, "exists"), Conflict),
        (OSError(errno.EEXIST, "exists"), Conflict),
        (FileNotFoundError(errno.ENOENT, "gone"), NotFound),
        (PermissionError(errno.EACCES, "no"), PermissionDenied),
        (ConnectionResetError(errno.ECONNRESET, "reset"), TransientError),
        (TimeoutError("slow"), TransientError),
        (OSError(errno.EBUSY, "busy"), TransientError),
        (OSError(errno.ENAMETOOLONG, "long"), BadRequest),
        (OSError(errno.ENOSPC, "full"), StorageError),
        (EndpointConnectionError(endpoint_url="http://x"), TransientError),
        (ReadTimeoutError(endpoint_url="http://x"), TransientError),
        (NoCredentialsError(), PermissionDenied),
    ],
)
def test_os_and_botocore_errors_translate(exc: BaseException, kind: type[StorageError]) -> None:
    assert type(translate_error(exc)) is kind


def test_folder_collisions_depend_on_direction() -> None:
    assert type(translate_error(IsADirectoryError(errno.EISDIR, "dir"))) is NotFound
    assert type(translate_error(IsADirectoryError(errno.EISDIR, "dir"), writing=True)) is BadRequest


# ---------------------------------------------------------------- the retry loop


class _Flaky:
    """Raises the given real exceptions in order, then returns 'ok'."""

    def __init__(self, *failures: BaseException) -> None:
        self.failures, self.calls = list(failures), 0

    def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"


def test_transient_errors_are_retried_then_succeed() -> None:
    waits: list[float] = []
    flaky = _Flaky(translate_boto_error(_client_error("SlowDown", 503)), ConnectionResetError())
    assert call_with_retries(flaky, max_retries=5, sleep=waits.append) == "ok"
    assert flaky.calls == 3 and len(waits) == 2 and all(w > 0 for w in waits)


def test_retries_are_bounded() -> None:
    waits: list[float] = []
    flaky = _Flaky(*[TimeoutError()] * 10)
    with pytest.raises(TransientError):
        call_with_retries(flaky, max_retries=3, sleep=waits.append)
    assert flaky.calls == 4 and len(waits) == 3


@pytest.mark.parametrize(
    "exc, kind",
    [
        (_client_error("AccessDenied", 403), PermissionDenied),
        (_client_error("InvalidArgument", 400), BadRequest),
        (_client_error("PreconditionFailed", 412), Conflict),
        (FileNotFoundError(), NotFound),
    ],
)
def test_permanent_errors_are_never_retried(exc: BaseException, kind: type[StorageError]) -> None:
    waits: list[float] = []
    flaky = _Flaky(exc)
    with pytest.raises(kind):
        call_with_retries(flaky, max_retries=5, sleep=waits.append)
    assert flaky.calls == 1 and waits == []


def test_bugs_are_not_translated() -> None:
    with pytest.raises(ZeroDivisionError):
        call_with_retries(lambda: 1 // 0, max_retries=3, sleep=lambda _s: None)


def test_backoff_is_jittered_exponential_and_capped() -> None:
    for attempt in range(12):
        cap = min(2.0, 0.05 * 2**attempt)
        samples = {backoff_s(attempt) for _ in range(20)}
        assert all(cap / 2 <= s <= cap for s in samples)
        assert len(samples) > 1


def test_backoff_doubles_caps_resets_and_jitters() -> None:
    plain = Backoff(0.5, 3.0)
    assert [plain.next_s() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    plain.reset()
    assert plain.next_s() == 0.5 and plain.wait_for(40) == 3.0 and plain.attempts == 1
    jittered = Backoff(0.1, 5.0, jitter=True)
    for attempt in range(8):
        wait = min(5.0, 0.1 * 2**attempt)
        assert wait / 2 <= jittered.next_s() <= wait
    with pytest.raises(ValueError, match="first_s"):
        Backoff(1.0, 0.5)


class _Clock:
    """A fake monotonic clock that each attempt and each wait advance."""

    def __init__(self, attempt_s: float) -> None:
        self.now, self.attempt_s = 0.0, attempt_s

    def __call__(self) -> float:
        return self.now

    def sleep(self, wait_s: float) -> None:
        self.now += wait_s


def test_retries_stop_at_the_window_and_say_so() -> None:
    """An endpoint that takes 3 s to refuse each attempt: within a 10 s window there are three attempts,
    not six (max_retries=5), and the error names the window."""
    clock = _Clock(attempt_s=3.0)

    def down() -> None:
        clock.now += clock.attempt_s
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(TransientError, match=r"gave up after 3 attempts .*retry window 10 s"):
        call_with_retries(down, max_retries=5, sleep=clock.sleep, window_s=10.0, clock=clock)
    assert clock.now <= 10.0


def test_every_retry_is_logged_at_once(caplog: pytest.LogCaptureFixture) -> None:
    flaky = _Flaky(TimeoutError(), TimeoutError())
    with caplog.at_level("WARNING", logger="diloco.storage"):
        assert call_with_retries(flaky, max_retries=5, sleep=lambda _s: None, key="r/run.json") == "ok"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "retrying (attempt 2 of 6, next in" in lines[0] and "r/run.json" in lines[0]


def test_the_retry_window_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco.storage import open_store
    from diloco.storage.errors import RETRY_WINDOW_ENV, RETRY_WINDOW_S

    monkeypatch.delenv(RETRY_WINDOW_ENV, raising=False)
    assert open_store("memory://w").retry_window_s == RETRY_WINDOW_S
    monkeypatch.setenv(RETRY_WINDOW_ENV, "2.5")
    assert open_store("memory://w").with_retries(1).retry_window_s == 2.5
    monkeypatch.setenv(RETRY_WINDOW_ENV, "soon")
    with pytest.raises(BadRequest, match=RETRY_WINDOW_ENV):
        open_store("memory://w")


def test_a_file_store_without_botocore_still_tells_missing_from_broken(tmp_path) -> None:
    """On a machine without s3fs (a GPU box training into file://), a missing file is NotFound, not a storage
    failure: before the fix, the stand-in for botocore's error class was OSError, so `exists()` raised and a
    run could not even be created. Run in a fresh interpreter where importing botocore fails."""
    import os
    import subprocess
    import sys

    block = tmp_path / "block"
    for name in ("botocore", "s3fs"):
        (block / name).mkdir(parents=True)
        (block / name / "__init__.py").write_text(f"raise ImportError('no {name} on this machine')\n")
    probe = (
        "import sys\n"
        "from diloco.storage.store import open_store\n"
        "from diloco.storage import NotFound\n"
        "assert 'botocore.exceptions' not in sys.modules\n"
        f"store = open_store('file://{tmp_path / 'bucket'}')\n"
        "assert store.exists('run/versions/0.json') is False\n"
        "try:\n"
        "    store.get('run/missing')\n"
        "except NotFound:\n"
        "    print('not found, as it should be')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(block)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "not found, as it should be" in done.stdout

"""FaultyStore over a real store: outage windows fail every operation (and only inside the window),
error rates fail about that fraction, latency and bandwidth caps sleep, a write-count trip wire
SIGKILLs its process; the control object round-trips and its claim is exclusive.
Run: `.venv/bin/pytest tests/unit/test_chaos_faulty_store.py`.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from pathlib import Path

import pytest

from diloco.chaos.control import ChaosControl, StorageWindow, claim, read_control, write_control
from diloco.chaos.faulty_store import FaultyStore
from diloco.storage import RunKeys, TransientError, open_store
from diloco.storage.store import ObjectStore


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now, self.slept = now, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def faulty(tmp_path: Path, windows: list[StorageWindow], clock: Clock, seed: int = 0) -> FaultyStore:
    inner = ObjectStore(f"file://{tmp_path}/store", max_retries=0)  # no retries: one attempt per call
    return FaultyStore(inner, windows, seed=seed, clock=clock, sleep=clock.sleep)


def test_outage_window_fails_everything_inside_only(tmp_path: Path) -> None:
    clock = Clock(999.0)
    store = faulty(tmp_path, [StorageWindow(t0=1000.0, t1=1020.0, outage=True)], clock)
    store.put("a/b", b"before")
    clock.now = 1000.0
    for op in (lambda: store.get("a/b"), lambda: store.put("a/c", b"x"), lambda: store.list("a/"),
               lambda: store.put_if_absent("a/d", b"x"), lambda: store.exists("a/b")):
        with pytest.raises(TransientError, match="outage"):
            op()
    clock.now = 1020.0
    assert store.get("a/b") == b"before" and store.list("a/") == ["a/b"]
    assert store.injected == 5


def test_error_rate_is_about_right_and_real_store_is_reached(tmp_path: Path) -> None:
    store = faulty(tmp_path, [StorageWindow(t0=0.0, error_rate=0.3)], Clock(), seed=5)
    failures = 0
    for i in range(400):
        try:
            store.put(f"k/{i}", b"x")
        except TransientError:
            failures += 1
    assert 80 < failures < 160  # ~120 of 400
    assert len(open_store(f"file://{tmp_path}/store").list("k/")) == 400 - failures


def test_retries_ride_out_errors(tmp_path: Path) -> None:
    # 20 puts x 0.5**21: a spurious failure ~1e-5
    inner = ObjectStore(f"file://{tmp_path}/store", max_retries=20)
    store = FaultyStore(inner, [StorageWindow(t0=0.0, error_rate=0.5)], seed=1, sleep=lambda s: None)
    for i in range(20):
        store.put(f"k/{i}", b"x")  # call_with_retries absorbs the injected TransientErrors
    assert store.injected > 0


def test_latency_and_bandwidth(tmp_path: Path) -> None:
    clock = Clock()
    store = faulty(tmp_path, [StorageWindow(t0=0.0, latency_s=0.01, bandwidth_bps=1000.0)], clock)
    store.put("x", b"0" * 500)
    assert clock.slept == [pytest.approx(0.5), pytest.approx(0.01)]
    clock.slept.clear()
    assert store.get("x") == b"0" * 500
    assert clock.slept == [pytest.approx(0.01), pytest.approx(0.5)]


def _write_twice(url: str) -> None:
    store = FaultyStore(ObjectStore(url), [])
    store.die_after_writes = 1
    store.put("first", b"1")
    store.put("second", b"2")


def test_die_after_writes_kills_the_process(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    proc = mp.get_context("spawn").Process(target=_write_twice, args=(url,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert open_store(url).list("") == ["first"]


def test_control_round_trip_and_exclusive_claim(tmp_path: Path) -> None:
    store, keys = open_store(f"file://{tmp_path}/store"), RunKeys("r")
    assert read_control(store, keys) is None
    control = ChaosControl(seed=3, windows=[StorageWindow(t0=1.0, t1=2.0, outage=True)], slowdown={"a": 2.0})
    write_control(store, keys, control)
    assert read_control(store, keys) == control
    assert claim(store, keys, "s1") and not claim(store, keys, "s1")


def test_with_retries_changes_only_the_retry_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("diloco.storage.errors.backoff_s", lambda attempt: 0.0)
    clock = Clock(1000.0)
    store = faulty(tmp_path, [StorageWindow(t0=1000.0, outage=True)], clock).with_retries(5)
    quick = store.with_retries(1)
    assert isinstance(quick, FaultyStore) and quick.url == store.url and store.max_retries == 5
    for s, attempts in ((quick, 2), (store, 6)):
        before = s.injected
        with pytest.raises(TransientError, match="outage"):
            s.exists("a/b")
        assert s.injected - before == attempts  # the quick view gives up after one retry
    store.windows.clear()  # the views share the windows: storage back for both
    quick.put("a/b", b"x")
    assert store.get("a/b") == b"x"
    with pytest.raises(ValueError, match="max_retries"):
        store.with_retries(-1)

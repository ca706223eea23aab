"""ThrottledStore: a byte-rate cap each way (transfers queue FIFO per direction, full duplex), one round
trip per request, uploads visible only once sent, every view sharing one link; the real store is reached.
Run: `.venv/bin/pytest tests/unit/test_throttle.py`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from diloco.bench.throttle import Link, LinkSpec, ThrottledStore
from diloco.storage import NotFound, open_store
from diloco.storage.store import ObjectStore


class Clock:
    """A fake clock that sleeping advances."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def throttled(tmp_path: Path, spec: LinkSpec, clock: Clock) -> ThrottledStore:
    inner = ObjectStore(f"file://{tmp_path}/store", max_retries=0)
    return ThrottledStore(inner, Link(spec, clock=clock, sleep=clock.sleep))


def test_bytes_take_size_over_rate_each_way_plus_a_round_trip(tmp_path: Path) -> None:
    clock = Clock()
    store = throttled(tmp_path, LinkSpec(up_bytes_per_s=1000, down_bytes_per_s=4000, rtt_s=0.05), clock)
    store.put("a/b", b"x" * 2000)
    assert clock.now == pytest.approx(2.0 + 0.05)
    store.get("a/b")
    assert clock.now == pytest.approx(2.05 + 0.05 + 0.5)
    store.exists("a/b")
    assert clock.now == pytest.approx(2.6 + 0.05)
    snap = store.link.snapshot()
    assert snap["bytes_up"] == 2000 and snap["bytes_down"] == 2000 and snap["requests"] == 3
    assert snap["busy_up_s"] == pytest.approx(2.0) and snap["busy_down_s"] == pytest.approx(0.5)


def test_transfers_queue_on_one_direction_not_across(tmp_path: Path) -> None:
    """Two uploads issued at once take twice as long as one; a download alongside is not delayed."""
    link = Link(LinkSpec(up_bytes_per_s=1e5, down_bytes_per_s=1e5), clock=time.monotonic)
    store = ThrottledStore(ObjectStore(f"file://{tmp_path}/store"), link)
    store.put("d/0", b"y" * 10_000)
    t0 = time.monotonic()
    threads = [threading.Thread(target=store.put, args=(f"u/{i}", b"x" * 10_000)) for i in range(2)]
    threads.append(threading.Thread(target=store.get, args=("d/0",)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert link.waited_s["up"] >= 0.1 + 0.2 - 1e-6  # the second upload waited for the first
    assert link.waited_s["down"] == pytest.approx(0.1, abs=0.02)
    assert time.monotonic() - t0 >= 0.2 - 0.01


def test_an_upload_lands_only_after_it_was_sent(tmp_path: Path) -> None:
    seen: list[bool] = []
    raw = open_store(f"file://{tmp_path}/store")

    def sleep(seconds: float) -> None:
        seen.append(raw.exists("k/v"))

    store = ThrottledStore(ObjectStore(f"file://{tmp_path}/store"),
                           Link(LinkSpec(up_bytes_per_s=10.0), clock=lambda: 0.0, sleep=sleep))
    store.put("k/v", b"abc")
    assert seen == [False] and raw.get("k/v") == b"abc"


def test_views_share_the_link_and_errors_pass_through(tmp_path: Path) -> None:
    clock = Clock()
    store = throttled(tmp_path, LinkSpec(down_bytes_per_s=100, rtt_s=0.01), clock)
    view = store.with_retries(0)
    assert view.link is store.link and isinstance(view, ThrottledStore)
    with pytest.raises(NotFound):
        view.get("missing/key")
    assert store.link.snapshot()["requests"] == 1 and clock.now == pytest.approx(0.01)
    store.put("p/a", b"1")
    assert store.list("p/") == ["p/a"] and store.link.bytes["down"] == len("p/a") + 1


def test_uncapped_link_counts_but_never_waits(tmp_path: Path) -> None:
    clock = Clock()
    store = throttled(tmp_path, LinkSpec(), clock)
    store.put("a/b", b"x" * 10)
    assert store.get("a/b") == b"x" * 10 and clock.now == 0.0
    assert store.link.bytes == {"up": 10, "down": 10}


def test_spec_rejects_negative_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="rtt_s"):
        LinkSpec(rtt_s=-1.0)
    assert LinkSpec.symmetric(2.5, 0.02) == LinkSpec(2.5e6, 2.5e6, 0.02)

"""The courier: small writes off the training thread, latest per key wins, failures never fatal."""

from __future__ import annotations

import threading

from diloco.learner.courier import Courier


def test_latest_job_per_key_wins_and_order_is_kept() -> None:
    courier = Courier("test")
    gate, done = threading.Event(), []
    courier.post("gate", gate.wait)  # holds the thread so the next posts queue up
    for i in range(5):
        courier.post("status", lambda i=i: done.append(("status", i)))
    courier.post("events", lambda: done.append(("events", 0)))
    courier.post("status", lambda: done.append(("status", 99)))  # replaces 0..4, keeps status's place
    gate.set()
    assert courier.drain(10)
    assert done == [("status", 99), ("events", 0)]
    courier.close()


def test_a_failing_job_is_dropped_and_the_thread_lives_on(caplog) -> None:
    courier = Courier("test")
    done = []
    courier.post("a", lambda: 1 / 0)
    courier.post("b", lambda: done.append("b"))
    assert courier.drain(10)
    courier.post("c", lambda: done.append("c"))
    courier.close()
    assert done == ["b", "c"]
    assert "ZeroDivisionError" in caplog.text or "division by zero" in caplog.text


def test_close_runs_what_is_queued_then_refuses() -> None:
    courier = Courier("test")
    done = []
    courier.post("x", lambda: done.append("x"))
    courier.close()
    assert done == ["x"]
    try:
        courier.post("y", lambda: None)
    except RuntimeError as err:
        assert "closed" in str(err)
    else:
        raise AssertionError("a closed courier accepted a job")

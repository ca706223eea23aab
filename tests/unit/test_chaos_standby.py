"""Warm standbys in the goodput accounting, and the learner's join retried through storage trouble.

The same two-learner, 100 s event list as test_chaos_goodput, plus a spare for `a` waiting 10-55 s
and activated at its restart: the spare's idle time is neither "up" nor "ready", only `standby_s`.
Run: `.venv/bin/pytest tests/unit/test_chaos_standby.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_chaos_goodput import CHAIN, EVENTS, ev

from diloco.chaos.goodput import compute_goodput
from diloco.learner import loop as loops
from diloco.storage import TransientError


def spare(t: float, kind: str, **fields: object) -> dict:
    return ev(t, "supervisor", kind, role="standby", learner="a", pid=42, **fields)


def with_standby() -> list[dict]:
    events = [e for e in EVENTS if not (e["kind"] == "start" and e["t"] == 55.0)]
    events += [spare(10.0, "standby"), spare(55.0, "standby_end", how="activated"),
               ev(55.0, "supervisor", "start", role="learner", learner="a", pid=42, standby=True),
               ev(58.0, "supervisor", "standby", role="standby", learner="a", pid=43)]
    return sorted(events, key=lambda e: e["t"])


def test_standby_idle_time_is_not_up_time() -> None:
    plain = compute_goodput(EVENTS, CHAIN, ["a", "b"], checkpoint_cost_s=2.0)
    g = compute_goodput(with_standby(), CHAIN, ["a", "b"], checkpoint_cost_s=2.0)
    assert g.availability == pytest.approx(plain.availability) == pytest.approx(0.95)
    assert g.ready_fraction == pytest.approx(plain.ready_fraction)
    assert g.num_failures == plain.num_failures == 1
    assert g.standby_s == pytest.approx(45.0 + 42.0)  # 10-55 activated, 58-100 still waiting at the end
    assert plain.standby_s == 0.0


class FakeEvents:
    def __init__(self) -> None:
        self.flushes = 0

    def flush(self) -> bool:
        self.flushes += 1
        return True


class FakeLearner:
    name = "local-0"

    def __init__(self, failures: int) -> None:
        self.failures, self.joins, self.events = failures, 0, FakeEvents()

    def join(self) -> int:
        self.joins += 1
        if self.joins <= self.failures:
            raise TransientError("outage")
        return 3


def test_join_retries_storage_errors_then_flushes(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(loops.time, "sleep", sleeps.append)
    learner = FakeLearner(failures=3)
    assert loops.join_with_retry(learner, FakeLearner.join, lambda: False)
    assert learner.joins == 4 and learner.events.flushes == 1
    assert sleeps == [0.5, 1.0, 2.0]


def test_join_gives_up_after_bounded_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(loops.time, "sleep", sleeps.append)
    learner = FakeLearner(failures=100)
    with pytest.raises(TransientError):
        loops.join_with_retry(learner, FakeLearner.join, lambda: False, attempts=6)
    assert learner.joins == 6 and max(sleeps) <= loops.JOIN_BACKOFF_S[1]
    assert learner.events.flushes == 0


def test_join_wait_ends_when_the_run_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loops.time, "sleep", lambda s: None)
    learner = FakeLearner(failures=100)
    assert not loops.join_with_retry(learner, FakeLearner.join, lambda: True)
    assert learner.joins == 1


def test_cli_standby_exits_at_end_of_input_without_opening_the_run(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from diloco.cli import app

    missing = tmp_path / "no-such-bucket"
    result = CliRunner().invoke(app, ["learner", "--storage", f"file://{missing}", "--run-id", "r",
                                      "--learner", "local-0", "--no-prefect", "--standby"], input="")
    assert result.exit_code == 0, result.output
    assert not missing.exists()  # never opened: a standby reads nothing before it is started

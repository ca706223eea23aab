"""How a run ended, from the bucket's records alone (diloco.inspect.outcome): what ended it, and when that is
a failure — the target, the user's own stop or signal and a time limit with nothing failed are not; a learner
that failed for a reason a restart cannot fix or was given up, no delta merged, an end nobody asked for, and a
time limit after learner failures are. `diloco.RunFailed` is importable from the package and carries the
summary.

Run: .venv/bin/pytest tests/unit/test_outcome.py
"""

from __future__ import annotations

import pytest

import diloco
from diloco.inspect.outcome import ended_by, failed_learners, failure_lines, run_outcome
from diloco.run.failure import LEARNERS_CRASHED
from diloco.run.state import RunState
from diloco.storage.records import SupervisorLease

LEASE = SupervisorLease(epoch=2, owner="o", host="h", pid=1, kind="local", started_at=1000.0, t=1000.0,
                        timeout_s=60.0, deadline=2000.0)


def stopped(reason: str) -> RunState:
    return RunState("stopped", 3, 12, reason, LEASE)


@pytest.mark.parametrize(("state", "want"), [
    (RunState("finished", 12, 12, "target version", LEASE), "target"),
    (stopped("time limit"), "time limit"),
    (stopped("time limit (seen by a role: the supervisor did not stop the run)"), "time limit"),
    (stopped("operator"), "stop"), (stopped("my own reason"), "stop"),
    (stopped("interrupted"), "interrupted"), (stopped("terminated"), "terminated"),
    (stopped(LEARNERS_CRASHED), "learners crashed"),
    (stopped("lease lost"), "error"), (stopped("error: RoleUnstartable: nope"), "error"),
    (stopped("supervisor lost: the lease of pid 1 was not renewed for 60 s"), "error"),
    (RunState("running", 3, 12, None, LEASE), None), (RunState("idle", 3, 12), None),
])
def test_what_ended_a_run(state: RunState, want: str | None) -> None:
    assert ended_by(state) == want


def exit_event(learner: str, t: float, error: str, fatal: bool = False) -> dict:
    return {"kind": "exit", "source": "supervisor", "learner": learner, "t": t, "code": 1, "error": error,
            "log": f"/logs/{learner}.log", "fatal": fatal}


def test_the_target_the_users_stop_and_a_clean_time_limit_are_not_failures() -> None:
    for state in (RunState("finished", 12, 12, None, LEASE), stopped("operator"), stopped("interrupted")):
        out = run_outcome(state, [], [], deltas_merged=5)
        assert out["failure"] is None and out["failed_learners"] == []
    short = run_outcome(stopped("time limit"), [], [], deltas_merged=5)
    assert short == {"ended_by": "time limit", "short_of_target": True, "failed_learners": [],
                     "failure": None}
    assert run_outcome(stopped("operator"), [], [], deltas_merged=0)["failure"] is None  # the user asked


def test_a_restarted_learner_is_shown_and_fails_the_run_only_when_the_time_limit_ended_it_short() -> None:
    events = [exit_event("a", 999.0, "old session"), exit_event("a", 1001.0, "RuntimeError: boom")]
    done = run_outcome(RunState("finished", 12, 12, None, LEASE), [], events, deltas_merged=5)
    assert done["failure"] is None and done["failed_learners"] == [
        {"learner": "a", "failures": 1, "fatal": False, "given_up": False, "down": False,
         # the earlier session's failure is not this one's
         "error": "RuntimeError: boom", "log": "/logs/a.log"}]
    assert failure_lines(done["failed_learners"]) == [
        "learner a failed 1 time, restarted: RuntimeError: boom (log: /logs/a.log)"]
    short = run_outcome(stopped("time limit"), [], events, deltas_merged=5)["failure"]
    assert short == ("the time limit ended it short of its target after learner failures: learner a: "
                     "RuntimeError: boom")


def test_a_fatal_or_given_up_learner_no_contribution_and_an_unasked_end_fail_the_run() -> None:
    rows = [{"learner": "a", "state": "failed", "t": 1002.0, "error": "learner a: another layout",
             "fatal": True, "log": "/logs/a.log", "given_up": True},
            {"learner": "b", "state": "training", "t": 1003.0}]
    out = run_outcome(stopped(LEARNERS_CRASHED), rows,
                      [exit_event("a", 1001.0, "learner a: another layout", True)], deltas_merged=0)
    assert out["failure"] == ("learner a failed, and a restart cannot fix it: learner a: another layout; the "
                              f"run ended at version 3 of 12: {LEARNERS_CRASHED}; no learner contributed "
                              "(not one delta merged)")
    assert [f["learner"] for f in out["failed_learners"]] == ["a"] and out["failed_learners"][0]["down"]
    given_up = [{"kind": "exit", "learner": "b", "t": 1001.0 + i,
                 "error": "RuntimeError: x"} for i in range(3)]
    given_up.append({"kind": "give_up", "learner": "b", "t": 1005.0, "error": "RuntimeError: x"})
    failed = failed_learners([], given_up, since=1000.0)
    assert failed[0]["failures"] == 3 and failed[0]["given_up"]
    out = run_outcome(RunState("finished", 12, 12, None, LEASE), [], given_up, deltas_merged=9)
    assert out["failure"] == "learner b failed 3 times and was left down: RuntimeError: x"
    assert run_outcome(stopped("lease lost"), [], [], deltas_merged=9)["failure"] == \
        "the run ended at version 3 of 12: lease lost"


def test_run_failed_is_part_of_the_package_and_carries_the_summary() -> None:
    assert "RunFailed" in diloco.__all__
    err = diloco.RunFailed("run r failed: no learner contributed", {"run_id": "r"})
    assert (isinstance(err, RuntimeError) and err.summary == {"run_id": "r"}
            and "no learner contributed" in str(err))

"""The supervisor core's decisions, the same for every backend: restarts bounded with back-off, a removed
learner ended and never started again, a silent learner killed and restarted, a refused start not counted
(and, refused again and again, the run ends with the reason), planned restarts not counted, a paused role
left alone, a learner that failed for a reason a restart cannot fix given up at once, and every failed
learner's error line and log recorded (its own, or its log's last error line). The backend here is a scripted
one of our own Backend interface (no Prefect, no processes): what each backend does for real is tested in
tests/chaos (processes) and tests/deployment (a Prefect server).

Run: .venv/bin/pytest tests/unit/test_supervisor_core.py
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from diloco.configs import load_config
from diloco.run.context import RunContext
from diloco.run.create import create_run
from diloco.run.events import read_events
from diloco.run.signals import request_remove
from diloco.storage import open_store
from diloco.storage.records import LearnerStatus, read_record, write_record
from diloco.supervise import core
from diloco.supervise.core import ENDED, RUNNING, Job, RoleUnstartable, Supervisor


class ScriptedBackend:
    """Jobs run until the test says they ended; starts can be refused; records every call."""

    defer_evaluator = False

    def __init__(self) -> None:
        self.ended: dict[str, object] = {}  # job name -> exit detail, once the test ends it
        self.refuse: list[str] = []  # reasons for the next starts, refused in order
        self.started: list[str] = []
        self.killed: list[tuple[str, str]] = []
        self.paused: list[str] = []

    def start(self, job: Job, asked: float) -> str | None:
        if self.refuse:
            return self.refuse.pop(0)
        self.started.append(job.name)
        self.ended.pop(job.name, None)
        job.handle = f"{job.name}#{len(self.started)}"
        return None

    def state(self, job: Job) -> tuple[str, object]:
        return (ENDED, self.ended[job.name]) if job.name in self.ended else (RUNNING, None)

    def kill(self, job: Job, reason: str) -> None:
        self.killed.append((job.name, reason))
        self.ended[job.name] = -9

    def pause(self, job: Job) -> bool:
        self.paused.append(job.name)
        return True

    def resume(self, job: Job) -> bool:
        return True

    def tick(self, sup: Supervisor, now: float) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def ctx(tmp_path: Path) -> RunContext:
    cfg = load_config("tiny").with_overrides({"run.restart_backoff_s": 0.0, "run.max_restarts": 2,
                                              "run.heartbeat_timeout_s": 5.0})
    return create_run(open_store(f"file://{tmp_path}/bucket"), "core-1", cfg, learners=["a", "b"])


@pytest.fixture
def sup(ctx: RunContext) -> Supervisor:
    supervisor = Supervisor(ctx, ScriptedBackend())
    supervisor.start_all()
    return supervisor


def kinds(ctx: RunContext, name: str) -> list[str]:
    return [e["kind"] for e in read_events(ctx.store, ctx.keys) if e.get("learner") == name]


def test_start_all_starts_every_role_of_the_run(sup: Supervisor) -> None:
    assert sorted(sup.backend.started) == ["a", "b", "evaluator", "merger"]


def test_an_ended_role_is_restarted_until_the_bound(ctx: RunContext, sup: Supervisor) -> None:
    job = sup.jobs["a"]
    for attempt in range(1, 4):
        sup.backend.ended["a"] = 1
        sup.heal()  # sees the exit and, the back-off being 0, starts it again (or gives up)
        if attempt <= 2:
            assert job.restarts == attempt and job.handle is not None
    assert job.removed and job.handle is None
    sup.events.flush()
    got = kinds(ctx, "a")
    assert got.count("exit") == 3 and got.count("restart") == 2 and got[-1] == "give_up"


def test_a_healthy_stretch_resets_the_restart_count(sup: Supervisor) -> None:
    job = sup.jobs["a"]
    sup.backend.ended["a"] = 1
    sup.heal()
    assert job.restarts == 1
    sup.heal()  # seen running
    job.running_since = time.time() - 60  # up for longer than heartbeat_timeout_s
    sup.heal()
    assert job.restarts == 0


def test_a_removed_learner_is_not_started_again(ctx: RunContext, sup: Supervisor,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    request_remove(ctx, "b")
    job = sup.jobs["b"]
    sup.heal()
    assert job.removed and sup.backend.killed == []  # it ends itself after its phase
    sup.backend.ended["b"] = 0
    before = len(sup.backend.started)
    for _ in range(3):
        sup.heal()
    assert job.handle is None and len(sup.backend.started) == before
    sup.events.flush()
    assert "removed" in kinds(ctx, "b") and "restart" not in kinds(ctx, "b")


def test_a_removed_learner_still_running_after_the_grace_is_killed(ctx: RunContext, sup: Supervisor,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "remove_grace_s", lambda cfg: 0.0)
    request_remove(ctx, "a")
    sup.heal()
    time.sleep(0.01)
    sup.heal()
    assert sup.backend.killed == [("a", "removed, still running")]
    sup.heal()
    assert sup.jobs["a"].handle is None and sup.backend.started.count("a") == 1


def test_a_silent_learner_is_killed_and_restarted(ctx: RunContext, sup: Supervisor) -> None:
    job = sup.jobs["a"]
    sup.heal()  # seen running
    job.running_since = time.time() - 60
    write_record(ctx.store, ctx.keys.status("a"), LearnerStatus(
        learner="a", state="training", t=time.time() - 30, pid=1, seq=0, base_version=0, step=10, cursor=10,
        loss=3.0, bytes_published=100))
    sup.heal()  # silent: killed (ended)
    assert sup.backend.killed == [("a", "heartbeat stopped")]
    sup.heal()  # restarted
    assert job.restarts == 1 and job.handle is not None and sup.backend.started.count("a") == 2


def test_a_heartbeat_from_the_future_is_no_sign_of_life(ctx: RunContext, sup: Supervisor) -> None:
    """Issue #44: a status whose `t` is far ahead of the supervisor's clock (a learner's key may write its own
    status) is ignored, and said in the kill's reason; a beat a few seconds ahead (two honest clocks) still
    counts."""
    job = sup.jobs["a"]
    sup.heal()  # seen running
    job.running_since = time.time() - 60
    status = LearnerStatus(learner="a", state="training", t=time.time() + 5, pid=1, seq=0, base_version=0,
                           step=10, cursor=10, loss=3.0, bytes_published=100)
    write_record(ctx.store, ctx.keys.status("a"), status)
    sup.heal()
    assert sup.backend.killed == []
    write_record(ctx.store, ctx.keys.status("a"), status.model_copy(update={"t": time.time() + 3 * 86400}))
    sup.heal()
    ((name, why),) = sup.backend.killed
    assert name == "a" and why.startswith("heartbeat from the future (259") and why.endswith("ignored")


def test_a_refused_start_is_not_a_restart_and_endless_refusals_end_the_run(sup: Supervisor) -> None:
    job = sup.jobs["a"]
    sup.backend.ended["a"] = 1
    sup.backend.refuse = ["server busy"]
    sup.heal()  # sees the exit; the start is refused: no handle, no restart counted
    assert job.handle is None and job.restarts == 0 and job.refusals == 1
    job.next_start = 0.0
    sup.heal()
    assert job.handle is not None and job.restarts == 1 and job.refusals == 0
    sup.backend.ended["a"] = 1
    sup.backend.refuse = ["deployment 'learner/nope' not found"] * core.MAX_REFUSALS
    with pytest.raises(RoleUnstartable, match="not found"):
        for _ in range(core.MAX_REFUSALS):
            job.next_start = 0.0
            sup.heal()


def test_a_planned_restart_is_not_counted(sup: Supervisor) -> None:
    job = sup.jobs["a"]
    assert sup.restart_after("a", 0.0, reason="chaos")
    sup.heal()  # sees the exit, starts it at the planned time
    assert job.restarts == 0 and sup.backend.started.count("a") == 2


def test_a_paused_learner_is_left_alone(sup: Supervisor) -> None:
    job = sup.jobs["a"]
    assert sup.pause("a")
    sup.backend.ended["a"] = 1
    sup.heal()
    assert job.handle is not None and sup.backend.started.count("a") == 1
    assert sup.resume("a")
    sup.heal()
    assert sup.backend.started.count("a") == 2


def test_shutdown_writes_the_stop_and_kills_what_does_not_end(ctx: RunContext, sup: Supervisor) -> None:
    sup.backend.ended.update({"merger": 0, "evaluator": 0})
    sup.shutdown("test", grace_s=0.1)
    assert ctx.store.exists(ctx.keys.stop())
    assert sorted(n for n, _ in sup.backend.killed) == ["a", "b"]


def test_an_admitted_learner_is_started_and_a_removed_one_is_not_a_job(
        ctx: RunContext, sup: Supervisor, monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco.api.operate import admit_learner

    monkeypatch.setattr(core, "MEMBERS_EVERY_S", 0.0)
    admit_learner(ctx, None, "c")
    admit_learner(ctx, None, "w-0", start=False)  # e.g. run by hand elsewhere: admitted, not supervised here
    sup.heal()
    assert sup.backend.started.count("c") == 1 and "w-0" not in sup.jobs
    sup.events.flush()
    assert "admitted" in kinds(ctx, "c")
    request_remove(ctx, "b")
    fresh = Supervisor(ctx, ScriptedBackend())
    fresh.start_all()  # a new session (`diloco resume`) starts the members: not the removed one
    assert sorted(fresh.backend.started) == ["a", "c", "evaluator", "merger"]


class CrashingBackend(ScriptedBackend):
    """Every learner process ends at once with exit code 1 (a learner that cannot start on this machine)."""

    def state(self, job: Job) -> tuple[str, object]:
        return (ENDED, 1) if job.role == "learner" else super().state(job)


def test_a_run_whose_learners_all_crash_ends_with_that_reason(ctx: RunContext) -> None:
    """Before, it waited for the time limit with no one training and ended as "time limit"."""
    sup = Supervisor(ctx, CrashingBackend())
    sup.start_all()
    started = time.time()
    assert sup.run(tick_s=0.0) == core.LEARNERS_CRASHED
    assert time.time() - started < 30 and all(sup.jobs[n].given_up for n in ("a", "b"))
    assert sup.backend.started.count("a") == 1 + ctx.cfg.run.max_restarts


def test_one_learner_given_up_while_another_trains_keeps_the_run(ctx: RunContext) -> None:
    for other_removed in (False, True):  # then an operator removed the other: every learner down, one crashed
        sup = Supervisor(ctx, ScriptedBackend())
        sup.start_all()
        if other_removed:
            request_remove(ctx, "b")
        for _ in range(1 + ctx.cfg.run.max_restarts):
            sup.backend.ended["a"] = 1
            sup.heal()
        assert sup.jobs["a"].given_up and sup.jobs["b"].removed is other_removed
        assert sup._every_learner_crashed() is other_removed


def test_learners_all_removed_by_an_operator_are_not_a_crash(ctx: RunContext) -> None:
    sup = Supervisor(ctx, ScriptedBackend())
    sup.start_all()
    for name in ("a", "b"):
        request_remove(ctx, name)
    sup.heal()
    assert all(sup.jobs[n].removed for n in ("a", "b")) and not sup._every_learner_crashed()


def test_roles_on_cuda_are_never_forked() -> None:
    """A child forked from the zygote cannot initialise CUDA (seen on an H200: every learner crashed with
    "Cannot re-initialize CUDA in forked subprocess"), so CUDA runs exec their roles."""
    from diloco.supervise.zygote import forks_roles

    tiny = load_config("tiny")
    assert forks_roles(tiny.with_overrides({"learner.device": "cpu"}))
    assert not forks_roles(tiny.with_overrides({"learner.device": "cuda"}))
    assert not forks_roles(tiny.with_overrides({"learner.device": "cpu", "run.start_method": "exec"}))


class LoggingBackend(ScriptedBackend):
    """A backend that knows each job's log (as the local one does), for a process that could not say why it
    ended."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        self.log_dir = log_dir

    def failure_detail(self, job: Job) -> tuple[str | None, str | None]:
        from diloco.supervise.failures import last_error_line

        path = str(self.log_dir / f"{job.name}.log")
        return last_error_line(path), path


def test_a_learner_that_cannot_start_for_a_reason_a_restart_cannot_fix_is_given_up_at_once(
        ctx: RunContext) -> None:
    """Its process recorded `failed` and `fatal` (a layout the run does not have: diloco.launch); restarting
    it would run the same code on the same config, so it is left down at once, its error line and log in its
    events and status."""
    from diloco.run.failure import write_failed_status

    sup = Supervisor(ctx, ScriptedBackend())
    sup.start_all()
    error = ("learner a: the spec builds another model than run 'core-1': parameter 0 ('w'): shape [17] "
             "where the run has [16]")
    write_failed_status(ctx.store, ctx.keys, "a", error=error, fatal=True, log_at="/logs/a.log")
    sup.backend.ended["a"] = 2
    sup.heal()  # sees the exit: its failure read
    sup.heal()  # after the back-off (0 here): given up, not started again
    job = sup.jobs["a"]
    assert job.given_up and sup.backend.started.count("a") == 1 and job.failure.fatal
    sup.events.flush()
    events = {e["kind"]: e for e in read_events(ctx.store, ctx.keys) if e.get("learner") == "a"}
    assert (events["exit"]["error"] == error and events["exit"]["log"] == "/logs/a.log"
            and events["exit"]["fatal"])
    assert events["give_up"]["error"] == error and "restart" not in events
    status = read_record(ctx.store, ctx.keys.status("a"), LearnerStatus)
    assert (status.state, status.error, status.fatal, status.given_up) == ("failed", error, True, True)


def test_a_crashed_learner_that_wrote_nothing_gets_its_logs_last_error_line_and_a_restart(
        ctx: RunContext, tmp_path: Path) -> None:
    sup = Supervisor(ctx, LoggingBackend(tmp_path))
    sup.start_all()
    (tmp_path / "a.log").write_text("2026-12-04 diloco.learner WARNING slow storage\n"
                                    "Traceback (most recent call last):\n"
                                    '  File "x.py", line 1\n'
                                    "RuntimeError: cannot install version 3: global/3-ab.update\n"
                                    "12:00:01 | INFO | Finished in state Failed\n")
    sup.backend.ended["a"] = 1
    sup.heal()
    job = sup.jobs["a"]
    assert job.restarts == 1 and not job.given_up  # a restart may fix it
    status = read_record(ctx.store, ctx.keys.status("a"), LearnerStatus)
    assert (status.state == "failed"
            and status.error == "RuntimeError: cannot install version 3: global/3-ab.update")
    assert status.log == str(tmp_path / "a.log") and not status.fatal and not status.given_up
    sup.backend.ended["b"] = -9  # killed (out of memory): why is not in its log
    sup.heal()
    assert sup.jobs["b"].failure.error == "killed by signal 9"


class MergerCrashingBackend(LoggingBackend):
    """The merger's process ends at once with exit code 2 (it cannot load the newest version), every time."""

    def state(self, job: Job) -> tuple[str, object]:
        return (ENDED, 2) if job.role == "merger" else super().state(job)


def test_a_merger_left_down_ends_the_run_with_its_error(ctx: RunContext, tmp_path: Path) -> None:
    """Nothing can be merged without it: the run ends at once with the merger's error line (a failure, not the
    time limit's quiet end), and its failures are not counted as a learner's."""
    from diloco.inspect.outcome import ended_by, failed_learners
    from diloco.run.state import read_run_state

    (tmp_path / "merger.log").write_text("error: version 3's params global/3-ab.params is corrupt (read 3 "
                                         "times)\n")
    sup = Supervisor(ctx, MergerCrashingBackend(tmp_path))
    sup.start_all()
    reason = sup.run(tick_s=0.0)
    assert reason == (f"{core.MERGER_FAILED}: error: version 3's params global/3-ab.params is corrupt "
                      "(read 3 times)")
    assert sup.jobs["merger"].given_up and sup.backend.started.count("merger") == 1 + ctx.cfg.run.max_restarts
    sup.events.flush()
    assert failed_learners([], read_events(ctx.store, ctx.keys), 0.0) == []
    sup.shutdown(reason, grace_s=0.0)
    assert ended_by(read_run_state(ctx)) == "error"  # a failure: the run ended for a reason nobody asked for

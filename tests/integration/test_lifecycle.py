"""The run lifecycle without training processes: the supervisor's lease (one live supervisor, takeover of a
dead one), roles that notice a vanished supervisor and record the stop, stop checks that give up at once in
a storage outage and a watched one that never waits on a hanging bucket, where a run stands (running,
finished, stopped, idle) and what `diloco run`, `learner`, `merge` and `status` say about an ended run (and
`status` about a paused one; operator commands on an ended run say they apply once it is resumed),
SIGTERM / SIGINT during supervision (a real signal to this process), and a learner that finds its run ended
(it neither joins nor overwrites its status).

Run: .venv/bin/pytest tests/integration/test_lifecycle.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from diloco.chaos.control import StorageWindow
from diloco.chaos.faulty_store import FaultyStore
from diloco.configs import load_config
from diloco.run.context import RunContext, RunError
from diloco.run.create import create_run
from diloco.run.lease import LeaseHeld, acquire, is_live, read_current
from diloco.run.signals import RoleStop, SupervisorSignal, read_stop_reason, request_remove, request_stop
from diloco.run.state import learner_word, read_run_state, refuse_to_start
from diloco.storage import open_store
from diloco.storage.records import LearnerStatus, read_record, write_record
from diloco.supervise.core import ENDED, RUNNING, Job, Supervisor


@pytest.fixture
def ctx(tmp_path: Path) -> RunContext:
    url = f"file://{tmp_path}/bucket"
    cfg = load_config("tiny").with_overrides({"run.num_learners": 2, "run.heartbeat_timeout_s": 5.0,
                                              "run.num_versions": 3, "run.storage": url})
    (tmp_path / "life.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return create_run(open_store(url), "life-1", cfg)


def _diloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_one_live_supervisor_per_run_and_a_dead_ones_lease_is_taken_over(ctx: RunContext) -> None:
    first = acquire(ctx, "local")
    with pytest.raises(LeaseHeld, match=rf"already supervised by pid {os.getpid()}"):
        acquire(ctx, "local")
    first.release("target version")
    second = acquire(ctx, "local")  # released: free again, next epoch
    assert second.record.epoch == 2 and is_live(read_current(ctx.store, ctx.keys))
    # a supervisor on this host whose process is gone: its lease is not live, though renewed just now
    dead = second.record.model_copy(update={"pid": 2**22 + 12345, "t": time.time()})
    write_record(ctx.store, ctx.keys.lease(2), dead)
    third = acquire(ctx, "local")
    assert third.record.epoch == 3
    assert not second.renew(force=True) and "took over" in second.lost  # the old one notices and yields


def test_a_role_stops_when_the_supervisor_goes_silent_and_records_why(ctx: RunContext) -> None:
    lease = acquire(ctx, "local")
    clock = {"now": 100.0}
    watch = SupervisorSignal(ctx, every_s=0.0, clock=lambda: clock["now"])
    assert not watch()
    lease.renew(force=True)
    clock["now"] += 4.0
    assert not watch()  # the beat moved: alive
    clock["now"] += 5.5  # > timeout_s (5) without a new beat
    assert watch() and "not renewed for 5 s" in watch.reason
    stop = RoleStop(ctx)
    stop.supervisor = watch
    assert stop() and stop.why == "stopped"
    assert read_stop_reason(ctx).startswith("supervisor lost")
    assert read_run_state(ctx).word == "stopped"


def test_a_released_or_missing_lease_is_not_watched(ctx: RunContext) -> None:
    clock = {"now": 100.0}
    watch = SupervisorSignal(ctx, every_s=0.0, clock=lambda: clock["now"])
    clock["now"] += 1000
    assert not watch()  # never supervised: roles started by hand run on
    acquire(ctx, "local").release("stop requested")
    clock["now"] += 1000
    assert not watch() and not watch()


def test_role_stop_says_finished_removed_or_stopped(ctx: RunContext) -> None:
    removed = RoleStop(ctx, 3, learner="local-1")
    request_remove(ctx, "local-1")
    assert removed() and removed.why == "removed"
    request_stop(ctx, "target version")
    finished = RoleStop(ctx, 3, learner="local-0")
    assert finished() and finished.why == "finished"


def test_a_roles_stop_checks_fail_fast_in_a_storage_outage(ctx: RunContext) -> None:
    # A learner checks RoleStop between phases and at every probe. In an outage each check must give up
    # after one quick retry ("not yet"); a full retry budget stalled the training thread ~1.2 s per check,
    # so learners trained at a quarter of their speed through the goodput bench's 20 s outage.
    outage = FaultyStore(ctx.store, [StorageWindow(t0=0.0, outage=True)])
    stop = RoleStop(dataclasses.replace(ctx, store=outage), 3, learner="local-0")
    assert not stop() and stop.why is None
    assert outage.injected == 6  # stop, removed, supervisor: two attempts each


def test_a_watched_role_stop_never_waits_on_a_hanging_bucket(ctx: RunContext) -> None:
    # A learner's RoleStop is watched (launch.make_learner): a call only reads what its thread found, so a
    # bucket that hangs (an endpoint that stops answering) never holds up the training thread.
    hanging, release = threading.Event(), threading.Event()

    def sleep(_: float) -> None:  # the injected latency: none, or hang until released
        if hanging.is_set():
            release.wait()

    store = FaultyStore(ctx.store, [StorageWindow(t0=0.0, latency_s=1.0)], sleep=sleep)
    stop = RoleStop(dataclasses.replace(ctx, store=store), 3, learner="local-0")
    stop.stop.every_s = stop.removed.every_s = stop.supervisor.every_s = 0.0  # every check asks the bucket
    stop.watch(every_s=0.01)
    try:
        assert not stop()  # the first check ran on this thread, the bucket answering: nothing to stop
        hanging.set()  # from now on every request hangs
        answers: list[bool] = []
        caller = threading.Thread(target=lambda: answers.extend(stop() for _ in range(1000)), daemon=True)
        caller.start()
        caller.join(timeout=30)
        assert not caller.is_alive() and answers == [False] * 1000  # none of them touched the bucket
        request_stop(ctx, "operator")  # through the run's own store
        hanging.clear()
        release.set()
        deadline = time.time() + 30
        while not stop() and time.time() < deadline:
            time.sleep(0.05)
        assert stop() and stop.why == "stopped" and stop.reason == "operator"  # the thread saw it
    finally:
        stop.close()
        release.set()


def test_a_watched_role_stop_hands_an_unexpected_error_to_its_caller(ctx: RunContext) -> None:
    stop = RoleStop(ctx, 3, learner="local-0")
    stop.stop.every_s = 0.0
    stop.watch(every_s=0.01)

    def broken() -> bool:
        raise ValueError("a check broke")

    stop.stop = broken  # type: ignore[assignment]  # not storage trouble: a bug, or a record it cannot read
    try:
        deadline = time.time() + 30
        with pytest.raises(ValueError, match="a check broke"):
            while time.time() < deadline:
                stop()
                time.sleep(0.01)
    finally:
        stop.close()


def test_where_a_run_stands_and_what_its_commands_say(ctx: RunContext) -> None:
    assert read_run_state(ctx).word == "idle"
    lease = acquire(ctx, "local")
    state = read_run_state(ctx)
    assert state.word == "running" and f"pid {os.getpid()}" in state.title()
    with pytest.raises(LeaseHeld):
        refuse_to_start(ctx)
    config = str(Path(ctx.store.url.removeprefix("file://")).parent / "life.yaml")
    # renewed as a live supervisor does, however slowly the CLI starts under load
    renewing = threading.Event()

    def renew() -> None:
        while not renewing.wait(1.0):
            lease.renew(force=True)

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        done = _diloco("run", "--config", config, "--run-id", ctx.run_id, "--no-prefect")
    finally:
        renewing.set()
        renewer.join()
    assert done.returncode == 2 and "already supervised by pid" in done.stderr, done.stderr
    request_stop(ctx, "interrupted")
    lease.release("interrupted")
    with pytest.raises(RunError,
                       match=r"stopped at version 0 of 3 \(interrupted\).*continue with: diloco resume"):
        refuse_to_start(ctx)
    for role in (("learner", "--learner", "local-0"), ("merge",)):
        done = _diloco(*role, "--storage", ctx.store.url, "--run-id", ctx.run_id)
        assert (done.returncode == 2
                and "is stopped at version 0 of 3 (interrupted)" in done.stderr), done.stderr
        assert f"diloco resume --run-id {ctx.run_id}" in done.stderr
    status = _diloco("status", "--storage", ctx.store.url, "--run-id", ctx.run_id, "--json")
    report = json.loads(status.stdout.strip().splitlines()[-1])
    assert report["state"] == "stopped" and report["title"].startswith("stopped at version 0")


def test_status_of_a_paused_run_says_paused_not_pending(ctx: RunContext) -> None:
    """A pause is in effect within a second (the merger reads the ops while it waits): the title says so, and
    the op is not listed as pending until a merge that, paused, never comes."""
    from typer.testing import CliRunner

    from diloco.api.operate import pause_merges
    from diloco.cli import app

    pause_merges(ctx, None, reason="inspect", by="ann@ops")
    lease = acquire(ctx, "local")
    try:
        shown = CliRunner().invoke(app, ["status", "--storage", ctx.store.url, "--run-id", ctx.run_id],
                                   terminal_width=200).output
    finally:
        lease.release("done")
    assert "running, merges paused · version 0 of 3" in shown and "merges PAUSED" in shown, shown
    assert "pending" not in shown, shown
    request_stop(ctx, "operator")
    shown = CliRunner().invoke(app, ["status", "--storage", ctx.store.url, "--run-id", ctx.run_id],
                               terminal_width=200).output
    assert "stopped at version 0 of 3 (operator) (merges paused)" in shown, shown


def test_operator_commands_on_an_ended_run_say_it_applies_when_resumed(ctx: RunContext) -> None:
    from typer.testing import CliRunner

    from diloco.cli import app

    def diloco(*args: str):
        return CliRunner().invoke(app, [args[0], "--storage", ctx.store.url, "--run-id", ctx.run_id,
                                        *args[1:]],
                                  terminal_width=200)

    live = diloco("set", "merger.quorum=1")
    assert live.exit_code == 0 and "has ended" not in live.output, live.output
    request_stop(ctx, "interrupted")
    for args in (("pause-merges",), ("resume-merges",), ("set", "merger.quorum=2"),
                 ("remove-learner", "--learner", "local-1"),
                 ("admit-learner", "--learner", "local-7", "--no-start")):
        done = diloco(*args)
        assert done.exit_code == 0, (args, done.output)
        assert f"run {ctx.run_id!r} has ended (stopped at version 0 of 3 (interrupted)): this applies when " \
               f"it is resumed; continue with: diloco resume --run-id {ctx.run_id}" in done.output, \
            (args, done.output)
    stop = diloco("stop")
    assert stop.exit_code == 2 and "nothing to stop" in stop.output, stop.output
    assert read_stop_reason(ctx) == "interrupted"  # the reason the run stopped for is kept


def test_learner_words_in_status() -> None:
    class _Run:
        def __init__(self, word: str) -> None:
            self.word, self.ended = word, word in ("finished", "stopped")

    # killed at the end: the run's word
    assert learner_word("training", False, _Run("finished")) == "finished"
    assert learner_word("training", True, _Run("running")) == "removed"
    assert learner_word("removed", False, _Run("stopped")) == "removed"
    assert learner_word("training", False, _Run("running")) == "training"


class _Backend:
    """Roles that run until killed; the supervisor's decisions are tested in
    tests/unit/test_supervisor_core.py."""

    defer_evaluator = False
    kind = "local"

    def __init__(self, ctx: RunContext) -> None:
        self.ctx, self.live = ctx, set()

    def start(self, job: Job, asked: float) -> str | None:
        job.handle = job.name
        self.live.add(job.name)
        return None

    def state(self, job: Job) -> tuple[str, object]:
        if self.ctx.store.exists(self.ctx.keys.stop()):
            self.live.clear()  # every role ends its phase on control/stop
        return (RUNNING, None) if job.name in self.live else (ENDED, 0)

    def kill(self, job: Job, reason: str) -> None:
        self.live.discard(job.name)

    def pause(self, job: Job) -> bool:
        return False

    def resume(self, job: Job) -> bool:
        return False

    def tick(self, sup: Supervisor, now: float) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("signum, reason", [(signal.SIGTERM, "terminated"), (signal.SIGINT, "interrupted")])
def test_a_signal_ends_supervision_in_order(ctx: RunContext, signum: int, reason: str) -> None:
    sup = Supervisor(ctx, _Backend(ctx))
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signum))
    timer.start()
    try:
        assert sup.run_to_end(tick_s=0.1, shutdown_grace_s=10) == reason
    finally:
        timer.cancel()
    assert read_stop_reason(ctx) == reason
    assert not sup.backend.live  # every role ended
    lease = read_current(ctx.store, ctx.keys)
    assert lease.released and lease.end_reason == reason
    assert signal.getsignal(signal.SIGTERM) is not None  # the handlers were put back


def test_a_learner_finds_its_run_ended_and_leaves_its_status_alone(ctx: RunContext) -> None:
    from diloco.launch import run_role

    status = LearnerStatus(learner="local-0", state="training", t=1.0, pid=1, seq=4, base_version=2, step=50,
                           cursor=9, loss=2.5, bytes_published=1234)
    write_record(ctx.store, ctx.keys.status("local-0"), status)
    request_stop(ctx, "operator")
    assert run_role("learner", ctx.store.url, ctx.run_id, "local-0") == 0
    assert read_record(ctx.store, ctx.keys.status("local-0"), LearnerStatus) == status


def test_a_learner_writes_its_final_state(ctx: RunContext) -> None:
    from diloco.launch import run_role

    assert run_role("learner", ctx.store.url, ctx.run_id, "local-0", phases=1) == 1
    assert read_record(ctx.store, ctx.keys.status("local-0"), LearnerStatus).state == "stopped"

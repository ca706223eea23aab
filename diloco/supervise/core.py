"""The supervisor core: one watch loop, one restart policy, the silence check and the stop/removed signals,
shared by every backend (local processes: supervise/local.py, Prefect deployments: supervise/deployments.py).

Contract: a role that ended, or a learner that went silent, while the run goes on is started again after a
back-off, at most `run.max_restarts` times in a row without a healthy stretch, then given up (a learner whose
start failed for a reason a restart cannot fix, its own status says, at once; each failed learner's error line
and log are in its `exit` / `give_up` events and its status: supervise/failures.py); a learner an
operator removed (`control/removed-<name>`) ends itself, is never started again, and is killed if it has not
ended REMOVE_GRACE_S (or run.heartbeat_timeout_s, if longer) after its removal was seen; a planned restart
(chaos, operator) is not a crash, and a paused role is left alone; the run ends at the target version, on a
stop request, at the time limit, on SIGINT or SIGTERM (supervise/interrupt.py: reason "interrupted" /
"terminated"), when its lease is lost, when every learner was given up (LEARNERS_CRASHED), or when `until`
holds; shutdown asks everyone to stop (control/stop with that reason), waits (a second signal: not at all),
then kills what is left, so no role of the run keeps running. run_to_end holds the run's lease (run/lease.py)
for its whole span: a second supervisor of a live run is refused, and roles whose supervisor vanished stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from diloco.run.context import RunContext
from diloco.run.controls import membership
from diloco.run.events import EventLog
from diloco.run.failure import LEARNERS_CRASHED, MERGER_FAILED
from diloco.run.fragments import ChainWatch, merger_ids
from diloco.run.lease import Lease, acquire
from diloco.run.signals import RemovedSignal, StopSignal, request_stop
from diloco.run.target import target_reached
from diloco.storage import NotFound, StorageError
from diloco.storage.errors import Backoff
from diloco.storage.records import LearnerStatus, RecordError, beat_age, read_record
from diloco.supervise import interrupt
from diloco.supervise.failures import Failure, failed_exit, mark_given_up, read_failure

log = logging.getLogger("diloco.supervisor")

RUNNING, STARTING, ENDED, UNKNOWN = "running", "starting", "ended", "unknown"
JOIN_WAIT_S = 30.0  # a deferred first start (the evaluator) waits for the learners' joins at most this long
REMOVE_GRACE_S = 30.0  # a removed learner ends itself after its phase; one still running after this (or the
# heartbeat timeout, if longer: a phase may be that slow) is killed
MEMBERS_EVERY_S = 5.0  # admitted learners (control ops) are looked for this often
MAX_REFUSALS = 6  # a role whose start is refused this many times in a row ends the run with the reason


def remove_grace_s(cfg) -> float:
    """How long a removed learner may still run: REMOVE_GRACE_S, or the heartbeat timeout if longer."""
    return max(REMOVE_GRACE_S, cfg.run.heartbeat_timeout_s)


class RoleUnstartable(RuntimeError):
    """A role could not be started at all (e.g. its deployment does not exist): the run cannot go on."""


@dataclass
class Job:
    """One role of the run (a learner, a merger, the evaluator) over its successive processes or flow runs."""

    role: str  # "learner" | "merger" | "evaluator"
    name: str
    spec: dict[str, Any] = field(default_factory=dict)  # what the backend starts it with (deployment, tags)
    handle: Any = None  # the backend's: a process, or a flow-run id; None while it is not running
    started_at: float = 0.0  # when its current start was asked for
    running_since: float | None = None  # first seen running (a flow run starts seconds after submission)
    restarts: int = 0  # restarts in a row without a healthy stretch
    next_start: float = 0.0  # back-off: not before this time
    removed: bool = False  # an operator removed it, or it was given up
    given_up: bool = False  # crashed run.max_restarts times in a row: left down
    removed_at: float | None = None
    paused: bool = False
    resumed_at: float = 0.0  # the silence check counts from here after a pause
    planned_restart_at: float | None = None  # a planned restart (chaos, operator): not a crash
    deferred_until: float | None = None  # a first start that waits for the learners' joins
    refusals: int = 0  # starts refused in a row (an API that did not take it)
    exits: list[Any] = field(default_factory=list)  # exit codes or final states, in order
    failure: Failure | None = None  # why its latest process failed (a learner's: supervise/failures.py)
    history: list[str] = field(default_factory=list)  # pids or flow-run ids, in order


class Backend(Protocol):
    """How a supervisor starts, watches and ends the roles of a run."""

    defer_evaluator: bool  # start the evaluator only once the learners joined (JOIN_WAIT_S at most)

    def start(self, job: Job, asked: float) -> str | None:
        """Start the job (sets job.handle); None when started, else why it was refused (tried again later)."""

    def state(self, job: Job) -> tuple[str, Any]:
        """(RUNNING | STARTING | ENDED | UNKNOWN, the exit code or final state when ENDED)."""

    def kill(self, job: Job, reason: str) -> None:
        """End the job now; its next state() is ENDED."""

    def pause(self, job: Job) -> bool: ...
    def resume(self, job: Job) -> bool: ...
    def tick(self, sup: Supervisor, now: float) -> None: ...
    def close(self) -> None: ...


class Supervisor:
    """Start every role through a backend, watch them, restart what ended, stop at the target."""

    def __init__(self, ctx: RunContext, backend: Backend, *, events: EventLog | None = None) -> None:
        self.ctx, self.cfg, self.backend = ctx, ctx.cfg, backend
        self.events = events or EventLog(ctx.store, ctx.keys, "supervisor")
        self.jobs: dict[str, Job] = {}
        self.hooks: list[Callable[[Supervisor], None]] = []  # chaos agents, progress displays
        self.started_at = time.time()
        self.backoff = Backoff(self.cfg.run.restart_backoff_s, self.cfg.run.restart_backoff_s * 32)
        self._removed = {}  # learner -> its RemovedSignal
        self._stop = StopSignal(ctx, None)
        self.watch = ChainWatch(ctx)  # its ticks list what is new on each chain, not every version
        self.learner_spec: Callable[[str], dict[str, Any]] = lambda name: {}  # a backend's learner job spec
        self._members_at = 0.0
        self.lease: Lease | None = None  # held by run_to_end

    # ---- jobs --------------------------------------------------------------------------------
    def add(self, role: str, name: str, **spec: Any) -> Job:
        job = Job(role, name, spec)
        self.jobs[name] = job
        if role == "learner":
            self._removed[name] = RemovedSignal(self.ctx, name)
        return job

    def add_run_roles(self) -> None:
        """The merger (every shard: merger, merger-s1, ...), the run's learners (run.json's, plus the
        admitted, minus the removed) and the evaluator, started in that order: the mergers' start (imports,
        flow run, state) is under way before the first delta arrives, a learner's first phase later."""
        for merger_id in merger_ids(self.ctx):
            self.add("merger", merger_id)
        for name in self._members():
            self.add("learner", name, **self.learner_spec(name))
        self.add("evaluator", "evaluator")

    def alive(self, job: Job) -> bool:
        return job.handle is not None and self.backend.state(job)[0] in (RUNNING, STARTING, UNKNOWN)

    def start(self, job: Job, asked: float | None = None) -> bool:
        """Ask the backend to start the job; a refusal is retried later and not counted as a restart."""
        asked = asked or time.time()
        refused = self.backend.start(job, asked)
        if refused is None:
            job.started_at, job.running_since, job.refusals = asked, None, 0
            return True
        job.refusals += 1
        job.next_start = time.time() + self.cfg.run.restart_backoff_s * 4
        self.events.emit("submit_failed", role=job.role, learner=job.name, reason=refused[:200])
        log.warning("run %s: could not start %s (%s); retrying", self.ctx.run_id, job.name, refused)
        if job.refusals >= MAX_REFUSALS:
            raise RoleUnstartable(f"{job.role} {job.name} could not be started {job.refusals} times in a "
                                  f"row: {refused}")
        return False

    def start_all(self) -> None:
        """Start every job now; with a deferring backend the evaluator once the learners joined."""
        if not self.jobs:
            self.add_run_roles()
        asked = time.time()  # several roles at once: each one's start-up counts from here
        for job in self.jobs.values():
            if job.role == "evaluator" and self.backend.defer_evaluator:
                job.deferred_until = asked + JOIN_WAIT_S
            else:
                self.start(job, asked)

    def joined(self, job: Job) -> bool:
        """Whether the job's current process has written a status since its start (learners do at join)."""
        if job.handle is None:
            return False
        try:
            status = read_record(self.ctx.store, self.ctx.keys.status(job.name), LearnerStatus)
        except (NotFound, StorageError, RecordError):
            return False
        return status.t >= job.started_at

    # ---- operator and chaos actions ------------------------------------------------------------
    def kill(self, name: str, reason: str = "") -> None:
        job = self.jobs[name]
        if job.handle is not None:
            self.backend.kill(job, reason)

    def restart_after(self, name: str, delay_s: float, reason: str = "") -> bool:
        """Kill a running role and start it again delay_s later; not counted toward max_restarts."""
        job = self.jobs[name]
        if not self.alive(job):
            return False
        job.planned_restart_at = time.time() + delay_s
        if job.paused:
            self.resume(name)
        self.backend.kill(job, reason or "planned restart")
        return True

    def pause(self, name: str, reason: str = "") -> bool:
        """Stop a role's process where it is (a straggler); heal() leaves it alone until resume()."""
        job = self.jobs[name]
        if job.paused or not self.alive(job) or not self.backend.pause(job):
            return False
        job.paused = True
        self.events.emit("pause", role=job.role, learner=name, reason=reason)
        return True

    def resume(self, name: str) -> bool:
        job = self.jobs[name]
        if not job.paused:
            return False
        job.paused, job.resumed_at = False, time.time()
        if job.handle is not None:
            self.backend.resume(job)
        self.events.emit("resume", role=job.role, learner=name)
        return True

    # ---- the watch loop --------------------------------------------------------------------------
    def heal(self) -> None:
        """One tick: removals, deferred starts, ended or silent roles, restarts, the backend's own upkeep."""
        now = time.time()
        self._start_deferred(now)
        self._admit_new(now)
        for job in self.jobs.values():
            if job.role == "learner" and not job.removed and self._removed[job.name]():
                self._remove(job, now)
            if job.paused or job.deferred_until is not None:
                continue
            if job.handle is not None:
                self._check(job, now)
            if job.handle is None and not job.removed and now >= job.next_start:
                self._restart(job)
        self.backend.tick(self, now)

    def _members(self) -> list[str]:
        try:
            return list(membership(self.ctx.store, self.ctx.keys, self.ctx.learners).supervised)
        except StorageError:
            return list(self.ctx.learners)

    def _admit_new(self, now: float) -> None:
        """A learner admitted while the run goes on (`diloco admit-learner`) gets a job and is started."""
        if now - self._members_at < MEMBERS_EVERY_S or not self.jobs:
            return
        self._members_at = now
        for name in self._members():
            if name not in self.jobs:
                log.info("run %s: learner %s was admitted; starting it", self.ctx.run_id, name)
                self.events.emit("admitted", role="learner", learner=name)
                self.start(self.add("learner", name, **self.learner_spec(name)))

    def _remove(self, job: Job, now: float) -> None:
        job.removed, job.removed_at, job.planned_restart_at = True, now, None
        if job.paused:
            self.resume(job.name)  # a stopped process cannot see its removal
        self.events.emit("removed", role=job.role, learner=job.name)
        log.info("learner %s was removed by an operator; it ends after its phase and is not restarted",
                 job.name)

    def _check(self, job: Job, now: float) -> None:
        state, detail = self.backend.state(job)
        if state == RUNNING and job.running_since is None:
            job.running_since = now
        if state == ENDED:
            self._ended(job, detail, now)
        elif state != RUNNING:
            return
        elif job.removed:
            if now - (job.removed_at or now) > remove_grace_s(self.cfg):
                self.backend.kill(job, "removed, still running")
        elif job.restarts and now - job.running_since > self.cfg.run.heartbeat_timeout_s:
            job.restarts = 0  # up for a while: healthy again; max_restarts bounds crash loops, not a lifetime
        elif job.role == "learner" and (why := self._silent(job, now)):
            self.backend.kill(job, why)

    def _ended(self, job: Job, detail: Any, now: float) -> None:
        job.exits.append(detail)
        job.failure = None  # the latest process's: its error line, its log, whether a restart can fix it
        if not job.removed and job.planned_restart_at is None and failed_exit(detail):
            job.failure = read_failure(self.ctx, self.backend, job, detail)
            log.error("%s %s failed: %s (log: %s)", job.role, job.name, job.failure.error,
                      job.failure.log or "none")
        job.handle = None
        self.events.emit("exit", role=job.role, learner=job.name,
                         **({"code": detail} if isinstance(detail, int) else {"state": str(detail)}),
                         **(job.failure.fields() if job.failure else {}))
        if job.planned_restart_at is not None:
            job.next_start = job.planned_restart_at
        else:
            job.next_start = now + self.backoff.wait_for(min(job.restarts, 5))

    def _restart(self, job: Job) -> None:
        if job.planned_restart_at is not None:
            self.events.emit("restart", role=job.role, learner=job.name, restarts=job.restarts, planned=True)
            job.planned_restart_at = None
            self.start(job)
            return
        fatal = job.failure is not None and job.failure.fatal
        if job.restarts >= self.cfg.run.max_restarts or fatal:  # a user error at start: a restart repeats it
            log.error("%s %s; leaving it down", job.name, "cannot be fixed by a restart" if fatal else
                      f"exceeded max_restarts={self.cfg.run.max_restarts}")
            self.events.emit("give_up", role=job.role, learner=job.name, restarts=job.restarts,
                             **(job.failure.fields() if job.failure else {}))
            job.removed = job.given_up = True
            if job.role == "learner":
                mark_given_up(self.ctx, job, job.failure)
            return
        job.restarts += 1
        if self.start(job):
            self.events.emit("restart", role=job.role, learner=job.name, restarts=job.restarts)
        else:
            job.restarts -= 1  # refused: that attempt never ran

    def _start_deferred(self, now: float) -> None:
        waiting = [j for j in self.jobs.values() if j.deferred_until is not None]
        if not waiting:
            return
        learners = [j for j in self.jobs.values() if j.role == "learner" and not j.removed]
        if now < waiting[0].deferred_until and not all(self.joined(j) for j in learners):
            return
        for job in waiting:
            job.deferred_until = None
            self.start(job)

    def _silent(self, job: Job, now: float) -> str:
        """Why the job counts as silent ("" if not): no heartbeat newer than heartbeat_timeout_s, counting
        from when it was seen running (or resumed); a beat from the future (records.beat_age) is none."""
        timeout = self.cfg.run.heartbeat_timeout_s
        since = max(job.running_since or now, job.resumed_at)
        if now - since < timeout:
            return ""
        try:
            beat = read_record(self.ctx.store, self.ctx.keys.status(job.name), LearnerStatus).t
        except NotFound:
            beat = 0.0
        except (StorageError, RecordError):
            return ""  # the bucket is the trouble, not the learner
        if beat_age(beat, now) is None:
            return f"heartbeat from the future ({beat - now:.0f}s ahead of the supervisor's clock): ignored"
        return "heartbeat stopped" if now - max(beat, since) > timeout else ""

    def latest(self) -> int:
        try:
            return self.watch.run_version() or 0  # fragments: the slowest fragment's version
        except StorageError:
            return -1

    def target_reached(self) -> bool:
        """The target version (or token budget, run.num_tokens) reached on every chain; False on trouble."""
        try:
            return target_reached(self.ctx, watch=self.watch)
        except StorageError:
            return False

    def run(self, tick_s: float = 0.5, on_tick: Callable[[Supervisor], None] | None = None,
            until: Callable[[Supervisor], bool] | None = None) -> str:
        """Watch until the target version, a stop request (`diloco stop`), the time limit, or `until(self)`
        holds ("done": a test's own end condition, checked each tick); returns why it ended."""
        limit = self.cfg.run.time_limit_s
        reason = "time limit"
        while time.time() - self.started_at < limit:
            if (caught := interrupt.received()) is not None:
                reason = caught.reason
                break
            if self.lease is not None and not self.lease.renew():
                reason = "lease lost"
                log.error("run %s: %s; this supervisor ends", self.ctx.run_id, self.lease.lost)
                break
            if self.target_reached():
                reason = "target version"
                break
            if self._stop():
                reason = "stop requested"  # the roles end their phase and exit; a restart would be wrong
                break
            if until is not None and until(self):
                reason = "done"
                break
            for hook in self.hooks:
                hook(self)
            self.heal()
            if merger := next((j for j in self.jobs.values() if j.role == "merger" and j.given_up), None):
                reason = (f"{MERGER_FAILED}: "
                          f"{merger.failure.error if merger.failure else 'it ended too often'}")
                log.error("run %s: %s; the run ends", self.ctx.run_id, reason)  # nothing can be merged now
                break
            if self._every_learner_crashed():
                reason = LEARNERS_CRASHED
                log.error("run %s: every learner is down for good (given up after run.max_restarts=%d "
                          "restarts in a row, or failed for a reason a restart cannot fix); the run ends",
                          self.ctx.run_id, self.cfg.run.max_restarts)
                break
            if on_tick:
                on_tick(self)
            self.events.flush()
            time.sleep(tick_s)
        self.events.emit("end", reason=reason, version=self.latest())
        return reason

    def _every_learner_crashed(self) -> bool:
        """Every learner is down for good and at least one was given up (not all removed by an operator): no
        one will train again, so waiting for the time limit would only hide the crash."""
        learners = [j for j in self.jobs.values() if j.role == "learner"]
        return bool(learners) and all(j.removed for j in learners) and any(j.given_up for j in learners)

    def shutdown(self, reason: str, grace_s: float = 60.0) -> None:
        """Ask everyone to stop (control/stop), wait for them (the final evaluation), end what is left."""
        try:
            if not self.ctx.store.exists(self.ctx.keys.stop()):
                request_stop(self.ctx, reason)
        except StorageError as err:
            log.warning("could not write control/stop: %s", err)
        for job in self.jobs.values():
            if job.paused:
                self.resume(job.name)  # a stopped process cannot see control/stop
        deadline = time.time() + grace_s
        live = [j for j in self.jobs.values() if j.handle is not None]
        while live and time.time() < deadline and not interrupt.hurried():
            live = [j for j in live if self.backend.state(j)[0] != ENDED]
            if live:
                time.sleep(0.2)
                if self.lease is not None:
                    self.lease.renew()  # still here: roles must not take the wait for a vanished supervisor
        for job in live:
            self.backend.kill(job, "did not stop in time")
        self.backend.close()
        self.events.emit("shutdown", reason=reason)
        self.events.flush()

    def run_to_end(self, shutdown_grace_s: float = 60.0, **run_kwargs: Any) -> str:
        """Take the run's lease (LeaseHeld if another supervisor is live), start_all, run, and always shut
        down (nothing of the run is left behind) and release the lease; returns why it ended. SIGINT and
        SIGTERM end it in order (supervise/interrupt.py)."""
        self.lease = acquire(self.ctx, getattr(self.backend, "kind", "local"))
        reason = "error"
        with interrupt.catch_signals():
            try:
                if (caught := interrupt.received()) is None:  # a signal before we got here: start nothing
                    self.start_all()
                    reason = self.run(**run_kwargs)
                else:
                    reason = caught.reason
            except KeyboardInterrupt:
                reason = "interrupted"  # the third signal: the shutdown below does not wait (hurried)
                raise
            except Exception as err:  # recorded as the stop reason, then raised on: the run failed
                reason = f"error: {type(err).__name__}: {err}"[:300]
                raise
            finally:
                self.shutdown(reason, grace_s=shutdown_grace_s)
                self.lease.release(reason)
        return reason

"""The chaos agent: a supervisor hook that injects a fault plan's faults as they come due.

Contract: `attach_chaos(supervisor, plan_path)` writes `control/chaos.json` (storage windows in unix
time, slowdowns) before any process starts, then each tick executes due faults; every fault is
recorded as an event of source `chaos` (injected, skipped, or ended) in the bucket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from diloco.chaos.control import ChaosControl, MergerKill, StorageWindow, write_control
from diloco.chaos.inject import Injector
from diloco.chaos.plan import (
    BadDelta,
    Due,
    KillLearner,
    KillMerger,
    KillRank,
    PauseLearner,
    Plan,
    SecondMerger,
    SeqBackwards,
    SlowLearner,
    StorageDegraded,
    StorageOutage,
    expand,
    load_plan,
)
from diloco.run.events import EventLog
from diloco.storage import NotFound, StorageError, read_manifest
from diloco.storage.records import LearnerStatus, RecordError, read_record
from diloco.supervise.core import Supervisor

log = logging.getLogger("diloco.chaos")


def storage_windows(plan: Plan, t0: float) -> list[StorageWindow]:
    out = []
    for f in plan.faults:
        if isinstance(f, StorageOutage):
            out.append(StorageWindow(t0=t0 + f.at_s, t1=t0 + f.at_s + f.duration_s, outage=True))
        elif isinstance(f, StorageDegraded):
            bps = f.bandwidth_mbps * 1e6 / 8 if f.bandwidth_mbps else None
            out.append(StorageWindow(t0=t0 + f.at_s,
                                     t1=None if f.duration_s is None else t0 + f.at_s + f.duration_s,
                                     error_rate=f.error_rate, latency_s=f.latency_s, bandwidth_bps=bps))
    return out


class ChaosAgent:
    """Called by the supervisor each tick; executes what is due, by time or by committed version."""

    def __init__(self, supervisor: Supervisor, plan: Plan) -> None:
        self.sup, self.plan, self.ctx = supervisor, plan, supervisor.ctx
        self.t0 = supervisor.started_at
        self.pending: list[Due] = expand(plan, self.ctx.learners, self.ctx.cfg.run.time_limit_s)
        self.timers: list[tuple[float, Callable[[], bool]]] = []  # (unix time, action -> done?)
        self.events = EventLog(self.ctx.store, self.ctx.keys, "chaos")
        self.injector = Injector(self.ctx)
        self.control = ChaosControl(seed=plan.seed, started_at=self.t0,
                                    windows=storage_windows(plan, self.t0))
        for due in self.pending:
            if isinstance(due.fault, SlowLearner) and due.fault.at_s == 0:
                self.control.slowdown[due.learner] = due.fault.factor
        write_control(self.ctx.store, self.ctx.keys, self.control)
        self.events.emit("chaos_plan", plan=plan.name, seed=plan.seed, started_at=self.t0,
                         faults=[self._describe(d) for d in self.pending])
        for w in self.control.windows:
            self.timers.append((w.t0, self._window_event("fault", w)))
            if w.t1 is not None:
                self.timers.append((w.t1, self._window_event("fault_end", w)))
        self.events.flush()

    @staticmethod
    def _describe(due: Due) -> dict:
        return {"fault_id": due.fault_id, "learner": due.learner, **due.fault.model_dump(exclude={"learner"})}

    def _window_event(self, kind: str, w: StorageWindow) -> Callable[[], bool]:
        fault = "storage_outage" if w.outage else "storage_degraded"
        return lambda: self.events.emit(kind, fault=fault, t0=w.t0, t1=w.t1, error_rate=w.error_rate,
                                        latency_s=w.latency_s) or True

    # ---- the tick ------------------------------------------------------------------------
    def __call__(self, sup: Supervisor) -> None:
        now = time.time()
        version = sup.latest()
        still = []
        for due in self.pending:
            if self._is_due(due, now, version):
                if not self._execute(due, version):
                    still.append(due)  # could not be made yet (e.g. no stale base): try again
            else:
                still.append(due)
        self.pending = still
        timers, self.timers = self.timers, []
        for at, action in timers:
            if now < at or not self._run_timer(action):
                self.timers.append((at, action))
        self.events.flush()

    @staticmethod
    def _run_timer(action: Callable[[], bool]) -> bool:
        try:
            return action()
        except (StorageError, ValueError) as err:  # ValueError: a manifest being written; next tick
            log.warning("chaos timer deferred: %s", err)
            return False

    def _is_due(self, due: Due, now: float, version: int) -> bool:
        if isinstance(due.fault, StorageOutage | StorageDegraded):
            return False  # windows live in the control object; their events are timers
        if isinstance(due.fault, SlowLearner) and due.fault.at_s == 0:
            return False  # applied through the control object at start
        if due.at_s is not None:
            return now - self.t0 >= due.at_s
        return version >= (due.at_version or 0)

    def _emit(self, due: Due, kind: str = "fault", **fields: object) -> None:
        self.events.emit(kind, fault=due.fault.kind, fault_id=due.fault_id, learner=due.learner, **fields)

    def _execute(self, due: Due, version: int) -> bool:
        f = due.fault
        try:
            if isinstance(f, KillLearner):
                return self._kill_learner(due, f)
            if isinstance(f, KillRank):
                return self._kill_rank(due, f)
            if isinstance(f, PauseLearner):
                return self._pause_learner(due, f)
            if isinstance(f, SlowLearner):
                return self._slow_learner(due, f)
            if isinstance(f, KillMerger):
                return self._kill_merger(due, f)
            if isinstance(f, SecondMerger):
                return self._second_merger(due, f)
            if isinstance(f, BadDelta):
                return self._bad_delta(due, f, version)
            if isinstance(f, SeqBackwards):
                return self._seq_backwards(due, f, version)
        except StorageError as err:  # the agent's own store is the real one; retry next tick
            log.warning("chaos fault %s not injected yet: %s", due.fault_id, err)
            return False
        raise AssertionError(f"unhandled fault {f!r}")

    # ---- the faults ----------------------------------------------------------------------
    def _kill_learner(self, due: Due, f: KillLearner) -> bool:
        if self.sup.restart_after(due.learner, f.restart_after_s, reason=f"chaos {due.fault_id}"):
            self._emit(due, restart_after_s=f.restart_after_s, signal=int(signal.SIGKILL))
        else:
            self._emit(due, "fault_skipped", reason="learner not running")
        return True

    def _kill_rank(self, due: Due, f: KillRank) -> bool:
        """SIGKILL one rank of a learner's world (its pid from the learner's status); the supervisor then sees
        the whole learner end and restarts it as one. Waits (False) until the learner reported its ranks."""
        try:
            status = read_record(self.ctx.store, self.ctx.keys.status(due.learner), LearnerStatus)
        except (NotFound, RecordError):
            return False
        pids = status.rank_pids or []
        if f.rank >= len(pids):
            self._emit(due, "fault_skipped", reason=f"learner has {len(pids) or 1} rank(s)")
            return True
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[f.rank], signal.SIGKILL)
        self._emit(due, rank=f.rank, pid=pids[f.rank], signal=int(signal.SIGKILL))
        return True

    def _pause_learner(self, due: Due, f: PauseLearner) -> bool:
        if not self.sup.pause(due.learner, reason=f"chaos {due.fault_id}"):
            self._emit(due, "fault_skipped", reason="learner not running or already paused")
            return True
        self._emit(due, duration_s=f.duration_s)

        def resume() -> bool:
            self.sup.resume(due.learner)
            self._emit(due, "fault_end")
            return True

        self.timers.append((time.time() + f.duration_s, resume))
        return True

    def _slow_learner(self, due: Due, f: SlowLearner) -> bool:
        self.control.slowdown[due.learner] = f.factor
        write_control(self.ctx.store, self.ctx.keys, self.control)
        self._emit(due, factor=f.factor)
        self.sup.restart_after(due.learner, 0.0, reason=f"chaos {due.fault_id}: slower hardware")
        return True

    def _kill_merger(self, due: Due, f: KillMerger) -> bool:
        self.control.merger_kills.append(MergerKill(fault_id=due.fault_id, stage=f.stage,
                                                    merger_id=f.merger_id))
        write_control(self.ctx.store, self.ctx.keys, self.control)
        self._emit(due, stage=f.stage, merger=f.merger_id)
        return True

    def _second_merger(self, due: Due, f: SecondMerger) -> bool:
        if f.merger_id in self.sup.jobs:
            self._emit(due, "fault_skipped", reason=f"{f.merger_id} already exists")
            return True
        self.sup.start(self.sup.add("merger", f.merger_id))
        self._emit(due, merger=f.merger_id)
        return True

    def _bad_delta(self, due: Due, f: BadDelta, version: int) -> bool:
        made = self.injector.bad_delta(f.variant, f.writer, max(version, 0))
        if made is None:
            return False
        key, expected = made
        self.events.emit("fault", fault="bad_delta", fault_id=due.fault_id, learner=f.writer,
                         variant=f.variant, key=key, expected=expected)
        return True

    def _seq_backwards(self, due: Due, f: SeqBackwards, version: int) -> bool:
        key = self.injector.seq_backwards(f.learner, max(version, 0), stage=0)
        self.events.emit("fault", fault="seq_backwards", fault_id=due.fault_id, learner=f.learner, key=key)

        def backwards() -> bool:
            latest = self.sup.latest()
            if latest < 1 or read_manifest(self.ctx.store, self.ctx.keys,
                                           latest).cursors.get(f.learner, -1) < 2:
                return False
            key = self.injector.seq_backwards(f.learner, latest, stage=1)
            self.events.emit("fault", fault="seq_backwards", fault_id=due.fault_id, learner=f.learner,
                             key=key, step="below the cursor")
            return True

        self.timers.append((time.time(), backwards))
        return True


def attach_chaos(supervisor: Supervisor, plan_path: str | Path) -> ChaosAgent:
    """Validate the plan, write the control object, and register the agent as a supervisor hook."""
    agent = ChaosAgent(supervisor, load_plan(plan_path))
    supervisor.hooks.append(agent)
    return agent

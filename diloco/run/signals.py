"""The control objects every role of a run watches: the stop request, a learner's removal, the supervisor's
lease.

Contract: `control/stop` (any reason) ends every role after its phase; `control/removed-<learner>` ends that
learner for good and no supervisor starts it again; a supervisor whose lease stopped moving for its timeout
(killed, or its host gone) ends the roles too, and the first role to see it records control/stop with that
reason. Each is checked at most once a second or two, with at most two attempts (one quick retry), so
storage trouble while checking means "not yet" at once, never a crash and never the store's whole retry
budget on the caller's thread. RoleStop combines them for a role and says why it ended (finished, stopped,
removed); a learner's RoleStop is watched (`RoleStop.watch`): checked on a thread of its own, so a learner's
training thread, which asks between phases and at every probe, never waits on the bucket, even one that
hangs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from diloco.run.context import RunContext
from diloco.run.controls import write_op
from diloco.run.fragments import ChainWatch
from diloco.run.lease import describe, read_current
from diloco.run.target import Target, target_reached
from diloco.storage import NotFound, StorageError, Store
from diloco.storage.records import RecordError, RemovedMark, StopRequest, read_record, write_record

TARGET_REASON = "target version"  # the supervisor's stop reason when the run reached its target


class StopSignal:
    """`control/stop` in the bucket, or the target version committed (or the token budget merged:
    run.num_tokens); checked at most every `every_s`."""

    def __init__(self, ctx: RunContext, target_version: int | None = None, every_s: float = 1.0) -> None:
        self.ctx, self.target, self.every_s = ctx, target_version, every_s
        self.store = ctx.store.with_retries(1)  # checked often: an outage must not stall the caller
        # each check lists what is new on each chain, not every version
        self.watch = ChainWatch(ctx, self.store)
        self._last, self._stopped = 0.0, False
        self.reason: str | None = None  # once stopped: control/stop's reason, or TARGET_REASON

    def __call__(self) -> bool:
        if self._stopped:
            return True
        now = time.time()
        if now - self._last < self.every_s:
            return False
        self._last = now
        try:
            if self.store.exists(self.ctx.keys.stop()):
                self._stopped, self.reason = True, read_stop_reason(self.ctx, self.store) or "stop requested"
            elif self.target is not None:  # the target version, or the token budget, on every chain
                target = Target(self.target, self.ctx.cfg.run.num_tokens)
                self._stopped = target_reached(self.ctx, self.store, target, self.watch)
                self.reason = TARGET_REASON if self._stopped else None
        except StorageError:
            return False
        return self._stopped


def read_stop_reason(ctx: RunContext, store: Store | None = None) -> str | None:
    """control/stop's reason (read through `store`, default the run's), or None when there is no (readable)
    stop request."""
    try:
        return read_record(store or ctx.store, ctx.keys.stop(), StopRequest).reason
    except (NotFound, RecordError):
        return None


def request_stop(ctx: RunContext, reason: str) -> None:
    """Ask every role of the run to end (control/stop)."""
    write_record(ctx.store, ctx.keys.stop(), StopRequest(reason=reason, t=time.time()))


def request_remove(ctx: RunContext, learner: str, reason: str = "operator", by: str | None = None) -> None:
    """Remove a learner for good: the `remove` control op (the merger rejects its deltas from its next merge),
    then the mark control/removed-<learner> (it ends after the current phase and is never restarted)."""
    write_op(ctx.store, ctx.keys, "remove", learner=learner, reason=reason, by=by)
    write_record(ctx.store, ctx.keys.removed(learner), RemovedMark(reason=reason, t=time.time()))


class RemovedSignal:
    """True once control/removed-<learner> exists; checked at most every `every_s`."""

    def __init__(self, ctx: RunContext, learner: str, every_s: float = 1.0) -> None:
        self.key, self.every_s = ctx.keys.removed(learner), every_s
        self.store = ctx.store.with_retries(1)  # an outage must not stall the caller (contract)
        self._last, self._removed = 0.0, False

    def __call__(self) -> bool:
        if not self._removed and time.time() - self._last >= self.every_s:
            self._last = time.time()
            try:
                self._removed = self.store.exists(self.key)
            except StorageError:
                return False
        return self._removed


class SupervisorSignal:
    """True once the run's supervisor is gone: its lease's beat has not moved for the lease's timeout_s on
    this process's clock (no clock skew between hosts), or the lease's deadline (the time limit) passed by as
    much again. A run with no lease, or whose supervisor released it, is not watched (roles run by hand)."""

    def __init__(self, ctx: RunContext, every_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx, self.every_s, self.clock = ctx, every_s, clock
        self.store = ctx.store.with_retries(1)
        self._last = 0.0
        self._seen: tuple[int, int] | None = None  # (epoch, beat) last seen, and since when (monotonic)
        self._since = 0.0
        self.reason: str | None = None

    def __call__(self) -> bool:
        if self.reason is not None:
            return True
        now = self.clock()
        if now - self._last < self.every_s:
            return False
        self._last = now
        try:
            lease = read_current(self.store, self.ctx.keys)
        except StorageError:
            return False
        if lease is None or lease.released:
            self._seen = None
            return False
        if (lease.epoch, lease.beat) != self._seen:
            self._seen, self._since = (lease.epoch, lease.beat), now
        elif now - self._since > lease.timeout_s:
            self.reason = (f"supervisor lost: the lease of {describe(lease)} was not renewed for "
                           f"{lease.timeout_s:g} s")
        if self.reason is None and time.time() > lease.deadline + lease.timeout_s:
            self.reason = "time limit (seen by a role: the supervisor did not stop the run)"
        return self.reason is not None


class RoleStop:
    """Everything that ends a role, checked in order: its removal (a learner), control/stop or the target
    version, a lost supervisor (then recorded as control/stop, so every role and `diloco status` see it).
    `why` once it fired: "removed", "finished" (the target version) or "stopped"; `reason` the detail."""

    def __init__(self, ctx: RunContext, target_version: int | None = None,
                 learner: str | None = None) -> None:
        self.ctx = ctx
        self.stop = StopSignal(ctx, target_version)
        self.removed = RemovedSignal(ctx, learner) if learner else None
        self.supervisor = SupervisorSignal(ctx)
        self.why: str | None = None
        self.reason: str | None = None
        self._watcher: threading.Thread | None = None
        self._closed = threading.Event()
        self._error: Exception | None = None  # what broke the watching thread: raised to the caller

    def watch(self, every_s: float = 0.5) -> RoleStop:
        """From now on check on a daemon thread every `every_s` (each signal keeps its own pace); a call
        then only reads what the thread found. The first check runs here, on the caller's thread; close()
        ends the thread, as does the stop itself."""
        self.check()
        self._watcher = threading.Thread(target=self._watch, args=(every_s,), name="role-stop", daemon=True)
        self._watcher.start()
        return self

    def _watch(self, every_s: float) -> None:
        try:
            while self.why is None and not self._closed.wait(every_s):
                self.check()
        except Exception as err:  # not storage trouble (that is "not yet"): the caller's next call raises it
            self._error = err

    def close(self) -> None:
        self._closed.set()

    def __call__(self) -> bool:
        if self._watcher is None:
            return self.check()
        if self._error is not None:
            raise self._error  # as an unwatched check would have, on the caller's thread
        return self.why is not None

    def check(self) -> bool:
        """Check every signal now (a watched RoleStop does this on its thread)."""
        if self.why is not None:
            return True
        if self.removed is not None and self.removed():
            self.why, self.reason = "removed", "removed by an operator"
        elif self.stop():
            self.reason = self.stop.reason
            self.why = "finished" if self.reason == TARGET_REASON else "stopped"
        elif self.supervisor():
            self.why, self.reason = "stopped", self.supervisor.reason
            # Conflict: another role (or the supervisor) recorded it first; trouble: the next role will
            with contextlib.suppress(StorageError):
                write_record(self.ctx.store, self.ctx.keys.stop(),
                             StopRequest(reason=self.reason, t=time.time()), exclusive=True)
        return self.why is not None

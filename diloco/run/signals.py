"""The control objects every role of a run watches: the stop request and a learner's removal.

Contract: `control/stop` (any reason) ends every role after its phase; `control/removed-<learner>` ends that
learner for good and no supervisor starts it again; both are checked at most once a second, and storage
trouble while checking means "not yet", never a crash.
"""

from __future__ import annotations

import time

from diloco.run.context import RunContext
from diloco.run.controls import write_op
from diloco.storage import StorageError, latest_version
from diloco.storage.records import RemovedMark, StopRequest, write_record


class StopSignal:
    """`control/stop` in the bucket, or the target version committed; checked at most every `every_s`."""

    def __init__(self, ctx: RunContext, target_version: int | None = None, every_s: float = 1.0) -> None:
        self.ctx, self.target, self.every_s = ctx, target_version, every_s
        self.store = ctx.store.with_retries(1)  # checked often: an outage must not stall the caller
        self._last, self._stopped = 0.0, False

    def __call__(self) -> bool:
        if self._stopped:
            return True
        now = time.time()
        if now - self._last < self.every_s:
            return False
        self._last = now
        try:
            if self.store.exists(self.ctx.keys.stop()):
                self._stopped = True
            elif self.target is not None:
                latest = latest_version(self.store, self.ctx.keys)
                self._stopped = latest is not None and latest >= self.target
        except StorageError:
            return False
        return self._stopped


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
        self.key, self.ctx, self.every_s = ctx.keys.removed(learner), ctx, every_s
        self._last, self._removed = 0.0, False

    def __call__(self) -> bool:
        if not self._removed and time.time() - self._last >= self.every_s:
            self._last = time.time()
            try:
                self._removed = self.ctx.store.exists(self.key)
            except StorageError:
                return False
        return self._removed

"""The chaos a process applies to itself: wrap its store in a FaultyStore, and the merger's self-kill.

Contract: without `control/chaos.json` nothing changes; a merger kill order is executed by exactly
one merger (exclusive-create claim) at the named stage, by SIGKILL, so nothing is cleaned up.
"""

from __future__ import annotations

import logging
import os
import signal

from diloco.chaos.control import ChaosControl, claim, read_control
from diloco.chaos.faulty_store import FaultyStore
from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.storage import StorageError
from diloco.storage.store import Store

log = logging.getLogger("diloco.chaos")


def apply_chaos(ctx: RunContext) -> ChaosControl | None:
    """Read the run's chaos control; if present, replace ctx.store with a FaultyStore over it."""
    try:
        control = read_control(ctx.store, ctx.keys)
    except StorageError as err:
        log.warning("chaos control unreadable (%s); running without injected faults", err)
        return None
    if control is not None and not isinstance(ctx.store, FaultyStore):
        ctx.store = FaultyStore(ctx.store, control.windows, seed=control.seed)
    return control


class MergerSaboteur:
    """A Merger.stage_hook: at each stage, look for a kill order for this merger and obey it."""

    def __init__(self, ctx: RunContext, raw_store: Store, merger_id: str, events: EventLog) -> None:
        self.ctx, self.raw, self.merger_id, self.events = ctx, raw_store, merger_id, events

    def __call__(self, stage: str) -> None:
        try:
            control = read_control(self.raw, self.ctx.keys)
        except StorageError:
            return
        if control is None:
            return
        for order in control.merger_kills:
            if order.stage != stage or order.merger_id != self.merger_id:
                continue
            if not claim(self.raw, self.ctx.keys, order.fault_id):
                continue  # already executed (by us before a restart, or by a twin)
            self._die(order.fault_id, stage)

    def _die(self, fault_id: str, stage: str) -> None:
        self.events.emit("chaos_self_kill", fault_id=fault_id, stage=stage, merger=self.merger_id)
        self.events.flush()
        store = self.ctx.store
        if stage == "writing" and isinstance(store, FaultyStore):
            store.die_after_writes = 1  # mid-write: the update lands, the params never do
            return
        os.kill(os.getpid(), signal.SIGKILL)

"""The chaos control object `control/chaos.json`: what every process of a run reads to fault itself.

Contract: written only by the chaos agent (overwritten as faults come due); storage windows are
absolute unix times so all processes agree; a process without the object runs fault-free.
"""

from __future__ import annotations

import json
import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco.storage import Conflict, NotFound, RunKeys, StorageError
from diloco.storage.store import Store

CONTROL_NAME = "chaos.json"


class StorageWindow(BaseModel):
    """Storage faults between unix times t0 and t1 (t1 None: forever)."""

    model_config = ConfigDict(extra="forbid")
    t0: float
    t1: float | None = None
    outage: bool = False  # every operation fails
    error_rate: float = Field(0.0, ge=0, lt=1)
    latency_s: float = Field(0.0, ge=0)
    bandwidth_bps: float | None = Field(None, gt=0)

    def active(self, now: float) -> bool:
        return self.t0 <= now and (self.t1 is None or now < self.t1)


class MergerKill(BaseModel):
    """An order to a merger: SIGKILL yourself at `stage` of your next merge (once: see done_key)."""

    model_config = ConfigDict(extra="forbid")
    fault_id: str
    stage: str
    merger_id: str = "merger"


class ChaosControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    started_at: float = Field(default_factory=time.time)
    windows: list[StorageWindow] = []
    slowdown: dict[str, float] = {}  # learner -> factor, read when the learner process starts
    merger_kills: list[MergerKill] = []


def control_key(keys: RunKeys) -> str:
    return keys.control(CONTROL_NAME)


def done_key(keys: RunKeys, fault_id: str) -> str:
    return keys.control(f"chaos-done-{fault_id}")


def write_control(store: Store, keys: RunKeys, control: ChaosControl) -> None:
    store.put(control_key(keys), control.model_dump_json(indent=1).encode())


def read_control(store: Store, keys: RunKeys) -> ChaosControl | None:
    """The run's chaos control, or None when the run has none (or it is unreadable right now)."""
    try:
        data = store.get(control_key(keys))
    except NotFound:
        return None
    try:
        return ChaosControl.model_validate(json.loads(data))
    except (ValueError, ValidationError):
        return None


def claim(store: Store, keys: RunKeys, fault_id: str) -> bool:
    """Exclusive create of the done marker: True for exactly one caller, ever."""
    try:
        store.put_if_absent(done_key(keys, fault_id), json.dumps({"t": time.time()}).encode())
        return True
    except Conflict:
        return False
    except StorageError:
        return False

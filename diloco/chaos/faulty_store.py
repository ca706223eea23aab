"""FaultyStore: the real store with injected faults — outages, error rates, latency, bandwidth caps.

Contract: a fault injector over the real store, not a fake: every operation still reaches the real
backend unless a fault fails it first. One retry layer: the wrapper runs the inner store's bounded
retries itself (over a no-retry view of it) and injects before each attempt.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from diloco.chaos.control import StorageWindow
from diloco.storage import errors
from diloco.storage.errors import TransientError
from diloco.storage.store import Store, check_key, check_prefix
from diloco.storage.wrapper import WrapperStore

T = TypeVar("T")


@dataclass
class Faults:
    """What every view of one FaultyStore (with_retries) shares: the windows, the dice, the counters."""

    windows: list[StorageWindow]
    rng: random.Random
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    lock: threading.Lock = field(default_factory=threading.Lock)
    injected: int = 0  # operations failed on purpose
    die_after_writes: int | None = None  # chaos: SIGKILL this process after that many writes


class FaultyStore(WrapperStore):
    """Wrap `inner`; faults come from `windows` (absolute unix times). `shared`: the state of another
    view (what with_retries passes); then windows, seed, clock and sleep come from it."""

    def __init__(self, inner: Store, windows: list[StorageWindow], *, seed: int = 0,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 shared: Faults | None = None) -> None:
        super().__init__(inner)
        self.faults = shared or Faults(list(windows), random.Random(seed * 1_000_003 + os.getpid()), clock,
                                       sleep)
        self._once = inner.with_retries(0)  # one attempt per call: the retries are run here

    def _over(self, inner: Store) -> FaultyStore:
        return FaultyStore(inner, [], shared=self.faults)

    def __repr__(self) -> str:
        return f"FaultyStore({self.url!r}, {len(self.windows)} windows)"

    @property
    def windows(self) -> list[StorageWindow]:
        return self.faults.windows

    @property
    def injected(self) -> int:
        return self.faults.injected

    @property
    def die_after_writes(self) -> int | None:
        return self.faults.die_after_writes

    @die_after_writes.setter
    def die_after_writes(self, count: int | None) -> None:
        self.faults.die_after_writes = count

    # ---- the faults ----------------------------------------------------------------------
    def _active(self) -> list[StorageWindow]:
        now = self.faults.clock()
        return [w for w in self.windows if w.active(now)]

    def _fail(self, message: str) -> TransientError:
        with self.faults.lock:
            self.faults.injected += 1
        return TransientError(message)

    def _inject(self, key: str) -> None:
        """Called once per attempt of every operation: sleep, or fail it."""
        active = self._active()
        latency = sum(w.latency_s for w in active)
        if latency:
            self.faults.sleep(latency)
        if any(w.outage for w in active):
            raise self._fail(f"{key!r}: chaos: storage outage")
        for w in active:
            with self.faults.lock:
                hit = self.faults.rng.random() < w.error_rate
            if hit:
                raise self._fail(f"{key!r}: chaos: injected storage error (rate {w.error_rate:g})")

    def _throttle(self, num_bytes: int) -> None:
        caps = [w.bandwidth_bps for w in self._active() if w.bandwidth_bps]
        if caps and num_bytes:
            self.faults.sleep(num_bytes / min(caps))

    def _attempts(self, fn: Callable[[], T], key: str, *, writing: bool = False) -> T:
        """fn() with the inner store's retry budget, a fault injected before each attempt."""
        def attempt() -> T:
            self._inject(key)
            return fn()

        return errors.call_with_retries(attempt, max_retries=self.max_retries, key=key, writing=writing)

    def _wrote(self) -> None:
        with self.faults.lock:
            if self.faults.die_after_writes is None:
                return
            self.faults.die_after_writes -= 1
            if self.faults.die_after_writes <= 0:
                os.kill(os.getpid(), signal.SIGKILL)

    # ---- the operations ------------------------------------------------------------------
    def _read(self, key: str) -> bytes:
        data = self._once.get(key)
        self._throttle(len(data))
        return data

    def get(self, key: str) -> bytes:
        check_key(key)
        return self._attempts(lambda: self._read(key), key)

    def get_size(self, key: str) -> int:
        check_key(key)
        return self._attempts(lambda: self._once.get_size(key), key)

    def modified(self, key: str) -> float:
        check_key(key)
        return self._attempts(lambda: self._once.modified(key), key)

    def exists(self, key: str) -> bool:
        check_key(key)
        return self._attempts(lambda: self._once.exists(key), key)

    def list(self, prefix: str, after: str = "") -> list[str]:
        check_prefix(prefix)
        return self._attempts(lambda: self._once.list(prefix, after), prefix)

    def folders(self, prefix: str) -> list[str]:
        check_prefix(prefix)
        return self._attempts(lambda: self._once.folders(prefix), prefix)

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        self._throttle(len(data))
        self._attempts(lambda: self._once.put(key, data), key, writing=True)
        self._wrote()

    def put_if_absent(self, key: str, data: bytes) -> None:
        check_key(key)
        self._throttle(len(data))
        self._attempts(lambda: self._once.put_if_absent(key, data), key, writing=True)
        self._wrote()

    def delete(self, key: str) -> None:
        check_key(key)
        self._attempts(lambda: self._once.delete(key), key, writing=True)

"""FaultyStore: the real ObjectStore with injected faults — outages, error rates, latency, bandwidth caps.

Contract: a fault injector over the real store, not a fake: every operation still reaches the real
backend unless a fault fails it first (TransientError, inside the store's own bounded retries).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from diloco.chaos.control import StorageWindow
from diloco.storage.errors import TransientError
from diloco.storage.store import ObjectStore

T = TypeVar("T")


class FaultyStore(ObjectStore):
    """Wrap `inner` (sharing its backend); faults come from `windows` (absolute unix times)."""

    def __init__(self, inner: ObjectStore, windows: list[StorageWindow], *, seed: int = 0,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        self.__dict__.update(inner.__dict__)  # same url, backend and retry budget as the real store
        self.inner = inner
        self.windows = list(windows)
        self.clock, self.sleep = clock, sleep
        self._rng = random.Random(seed * 1_000_003 + os.getpid())
        self._lock = threading.Lock()
        self.die_after_writes: int | None = None  # chaos: SIGKILL this process after that many writes
        self.injected = 0  # operations failed on purpose

    def __repr__(self) -> str:
        return f"FaultyStore({self.url!r}, {len(self.windows)} windows)"

    def _active(self) -> list[StorageWindow]:
        now = self.clock()
        return [w for w in self.windows if w.active(now)]

    def _inject(self, key: str) -> None:
        """Called once per attempt of every operation: sleep, or fail it."""
        active = self._active()
        latency = sum(w.latency_s for w in active)
        if latency:
            self.sleep(latency)
        if any(w.outage for w in active):
            self.injected += 1
            raise TransientError(f"{key!r}: chaos: storage outage")
        for w in active:
            with self._lock:
                hit = self._rng.random() < w.error_rate
            if hit:
                self.injected += 1
                raise TransientError(f"{key!r}: chaos: injected storage error (rate {w.error_rate:g})")

    def _throttle(self, num_bytes: int) -> None:
        caps = [w.bandwidth_bps for w in self._active() if w.bandwidth_bps]
        if caps and num_bytes:
            self.sleep(num_bytes / min(caps))

    def _call(self, fn: Callable[[], T], key: str, *, writing: bool = False) -> T:
        def faulty() -> T:
            self._inject(key)
            result = fn()
            if isinstance(result, bytes):
                self._throttle(len(result))
            return result

        return super()._call(faulty, key, writing=writing)

    def _wrote(self) -> None:
        if self.die_after_writes is None:
            return
        self.die_after_writes -= 1
        if self.die_after_writes <= 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def put(self, key: str, data: bytes) -> None:
        self._throttle(len(data))
        super().put(key, data)
        self._wrote()

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._throttle(len(data))
        super().put_if_absent(key, data)
        self._wrote()

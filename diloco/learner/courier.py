"""Small bucket writes that must not hold up training: a learner's status and its event batches.

Contract: one daemon thread; `post(key, job)` replaces a job of the same key not started yet (the latest
status wins, many flush requests are one flush), jobs run in the order their keys were first posted;
`cancel(key)` drops one not started; a job that raises is logged and dropped (statuses and events are best
effort, and EventLog keeps events whose flush failed); `close` runs what is queued, then stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("diloco.courier")


class Courier:
    def __init__(self, name: str = "courier") -> None:
        self.name = name
        self._jobs: dict[str, Callable[[], object]] = {}
        self._cond = threading.Condition()
        self._busy = False
        self._closing = False
        self._thread: threading.Thread | None = None

    def post(self, key: str, job: Callable[[], object]) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError(f"{self.name} is closed")
            self._jobs[key] = job  # a replaced job keeps its key's place in the order
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def cancel(self, key: str) -> bool:
        """Drop the job of `key` if it has not started; whether it was dropped."""
        with self._cond:
            dropped = self._jobs.pop(key, None) is not None
            self._cond.notify_all()
            return dropped

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closing)
                if not self._jobs:
                    return
                key = next(iter(self._jobs))
                job = self._jobs.pop(key)
                self._busy = True
            try:
                job()
            except Exception as err:  # never fatal: the next status or flush follows soon
                log.warning("%s: %s failed: %s", self.name, key, err)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def drain(self, timeout_s: float | None = 30.0) -> bool:
        """Wait until every posted job has run (or timeout_s passed; None: no limit); True when nothing is
        left."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout=timeout_s)

    def close(self, timeout_s: float | None = 30.0) -> None:
        self.drain(timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

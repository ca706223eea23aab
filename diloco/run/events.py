"""Lifecycle and fault events, buffered and written to the bucket as JSON-lines objects.

Contract: recording never raises into training — a failed flush keeps the buffer for the next
one; each flush is a new object under events/<source>/, so nothing is ever appended in place.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from diloco.storage import RunKeys, StorageError
from diloco.storage.store import Store

log = logging.getLogger("diloco.events")


class EventLog:
    """Buffer events of one source (a learner, the merger, the supervisor) and flush them."""

    def __init__(self, store: Store | None, keys: RunKeys | None, source: str) -> None:
        self.store, self.keys, self.source = store, keys, source
        self._buf: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._part = 0

    def emit(self, kind: str, **fields: Any) -> None:
        event = {"t": time.time(), "source": self.source, "kind": kind, "pid": os.getpid(), **fields}
        with self._lock:
            self._buf.append(event)

    def flush(self) -> bool:
        with self._lock:
            events, self._buf = self._buf, []
            if not events or self.store is None or self.keys is None:
                return True
            self._part += 1
            part = self._part
        name = f"{time.time_ns():020d}-{os.getpid()}-{part}"
        body = "\n".join(json.dumps(e, sort_keys=True) for e in events).encode() + b"\n"
        try:
            self.store.put(self.keys.event(self.source, name), body)
            return True
        except StorageError as err:
            log.warning("events of %s not flushed (%s); kept for the next flush", self.source, err)
            with self._lock:
                self._buf = events + self._buf
            return False


def read_events(store: Store, keys: RunKeys) -> list[dict[str, Any]]:
    """Every recorded event of a run, sorted by time; malformed lines are skipped."""
    events: list[dict[str, Any]] = []
    for key in store.list(keys.events_prefix()):
        try:
            lines = store.get(key).decode().splitlines()
        except (StorageError, UnicodeDecodeError):
            continue
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and isinstance(event.get("t"), (int, float)):
                events.append(event)
    events.sort(key=lambda e: e["t"])
    return events

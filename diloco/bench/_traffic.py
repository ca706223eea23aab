"""A store wrapper that counts the bytes one process actually writes and reads, by object kind.

Contract: behaves exactly like the wrapped ObjectStore; counts only successful get/put calls.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from diloco.storage.store import ObjectStore


def object_kind(key: str) -> str:
    """'delta', 'global' (params/update/outer), 'manifest', or 'other' (status, checkpoint, ...)."""
    parts = key.split("/")
    if "deltas" in parts:
        return "delta"
    if "global" in parts:
        return "global"
    if "versions" in parts:
        return "manifest"
    return "other"


class CountingStore:
    """Delegates to an ObjectStore; `sent[kind]` / `received[kind]` hold bytes put / got."""

    def __init__(self, inner: ObjectStore) -> None:
        self._inner = inner
        self._lock = threading.Lock()  # the publisher thread puts while the learner gets
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def reset(self) -> None:
        with self._lock:
            self.sent.clear()
            self.received.clear()

    def get(self, key: str) -> bytes:
        data = self._inner.get(key)
        with self._lock:
            self.received[object_kind(key)] += len(data)
        return data

    def put(self, key: str, data: bytes) -> None:
        self._inner.put(key, data)
        with self._lock:
            self.sent[object_kind(key)] += len(data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._inner.put_if_absent(key, data)
        with self._lock:
            self.sent[object_kind(key)] += len(data)

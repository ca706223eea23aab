"""A store wrapper that counts the bytes one process actually writes and reads, by object kind.

Contract: behaves exactly like the wrapped store; counts only successful get/put calls, in every
view of it (with_retries shares the counters).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from diloco.storage.store import Store
from diloco.storage.wrapper import WrapperStore


def object_kind(key: str) -> str:
    """'delta', 'global' (a version's state: update, a chain checkpoint's parts and JSON, params/outer objects
    of runs before the log), 'manifest', or 'other' (status, a learner's checkpoint, ...)."""
    parts = key.split("/")
    if "deltas" in parts:
        return "delta"
    if "global" in parts or "checkpoints" in parts:
        return "global"
    if "versions" in parts:
        return "manifest"
    return "other"


@dataclass
class Traffic:
    """Bytes put (`sent`) and got (`received`) by object kind; shared by every view of one CountingStore."""

    sent: Counter[str] = field(default_factory=Counter)
    received: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the publisher thread puts while the learner gets


class CountingStore(WrapperStore):
    """Forwards to `inner`; `sent[kind]` / `received[kind]` hold bytes put / got. `shared`: the counters
    of another view (what with_retries passes)."""

    def __init__(self, inner: Store, *, shared: Traffic | None = None) -> None:
        super().__init__(inner)
        self.traffic = shared or Traffic()

    def _over(self, inner: Store) -> CountingStore:
        return CountingStore(inner, shared=self.traffic)

    @property
    def sent(self) -> Counter[str]:
        return self.traffic.sent

    @property
    def received(self) -> Counter[str]:
        return self.traffic.received

    def reset(self) -> None:
        with self.traffic.lock:
            self.traffic.sent.clear()
            self.traffic.received.clear()

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        with self.traffic.lock:
            self.traffic.received[object_kind(key)] += len(data)
        return data

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        with self.traffic.lock:
            self.traffic.sent[object_kind(key)] += len(data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self.inner.put_if_absent(key, data)
        with self.traffic.lock:
            self.traffic.sent[object_kind(key)] += len(data)

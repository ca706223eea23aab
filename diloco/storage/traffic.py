"""A store wrapper that counts the bytes one process actually writes and reads, by object kind.

Contract: behaves exactly like the wrapped store; counts only successful calls, in every view of it
(with_retries shares the counters): the bytes of every object put and got, and of every listing its keys
(received as kind `listing`: the keys' bytes, a lower bound of what an S3 listing's XML carries). HEAD-like
calls (exists, get_size, modified) carry no body and count nothing.
"""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from dataclasses import dataclass, field

from diloco.storage.store import Store
from diloco.storage.wrapper import WrapperStore


def object_kind(key: str) -> str:
    """'delta' (and its signature), 'global' (a version's state: update, a chain checkpoint's parts and JSON,
    params/outer objects of runs before the log), 'manifest', 'checkpoint' (a learner's pointer and moments),
    'status', 'event', 'control', 'eval', or 'other' (run.json, the spec's files, ...)."""
    parts = key.split("/")
    if "deltas" in parts:
        return "delta"
    if "global" in parts or "checkpoints" in parts:
        return "global"
    if "versions" in parts:
        return "manifest"
    if "learners" in parts:
        return "checkpoint" if "checkpoint" in parts else "status" if parts[-1] == "status.json" else "other"
    for folder, kind in (("events", "event"), ("control", "control"), ("evals", "eval")):
        if folder in parts:
            return kind
    return "other"


@dataclass
class Traffic:
    """Bytes put (`sent`) and got (`received`) by object kind; shared by every view of one CountingStore."""

    sent: Counter[str] = field(default_factory=Counter)
    received: Counter[str] = field(default_factory=Counter)
    # the publisher thread puts while the learner gets
    lock: threading.Lock = field(default_factory=threading.Lock)
    # which counters (a report sums the last figures of each: two learners run one after the other in one
    # process are two sets of counters, not one)
    id: str = field(default_factory=lambda: secrets.token_hex(4))


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

    def list(self, prefix: str, after: str = "") -> list[str]:
        keys = self.inner.list(prefix, after)
        with self.traffic.lock:
            self.traffic.received["listing"] += sum(len(k) + 1 for k in keys)
        return keys

    def folders(self, prefix: str) -> list[str]:
        names = self.inner.folders(prefix)
        with self.traffic.lock:
            self.traffic.received["listing"] += sum(len(prefix) + len(n) + 2 for n in names)
        return names

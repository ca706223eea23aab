"""ThrottledStore: one site's link to the bucket — a byte-rate cap in each direction and a round trip per
request — over the real store (what `diloco bench wan` puts between every learner and the bucket).

Contract: behaves like the wrapped store, only later: every request waits one round trip; the bytes a
`put` uploads and a `get` (or a listing) downloads queue on their direction of the link, one transfer
after another (FIFO, full duplex), so the link never carries more than its cap; an upload lands in the
bucket only once it has been sent. Every view (with_retries) shares one Link and its counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco.storage.store import Store
from diloco.storage.wrapper import WrapperStore

UP, DOWN = "up", "down"


@dataclass(frozen=True)
class LinkSpec:
    """A link: bytes per second each way (0 = uncapped) and the round trip every request pays."""

    up_bytes_per_s: float = 0.0
    down_bytes_per_s: float = 0.0
    rtt_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("up_bytes_per_s", "down_bytes_per_s", "rtt_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"LinkSpec.{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def symmetric(cls, mb_per_s: float, rtt_s: float = 0.0) -> LinkSpec:
        """The same cap both ways, in MB/s (10^6 bytes)."""
        return cls(mb_per_s * 1e6, mb_per_s * 1e6, rtt_s)


@dataclass
class Link:
    """The shared state of one link: when each direction is next free, and what it carried."""

    spec: LinkSpec
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    lock: threading.Lock = field(default_factory=threading.Lock)
    free_at: dict[str, float] = field(default_factory=lambda: {UP: 0.0, DOWN: 0.0})
    bytes: dict[str, int] = field(default_factory=lambda: {UP: 0, DOWN: 0})
    busy_s: dict[str, float] = field(default_factory=lambda: {UP: 0.0, DOWN: 0.0})  # time spent sending
    waited_s: dict[str, float] = field(default_factory=lambda: {UP: 0.0, DOWN: 0.0})  # incl. queueing
    requests: int = 0

    def rate(self, direction: str) -> float:
        return self.spec.up_bytes_per_s if direction == UP else self.spec.down_bytes_per_s

    def round_trip(self) -> None:
        with self.lock:
            self.requests += 1
        if self.spec.rtt_s > 0:
            self.sleep(self.spec.rtt_s)

    def carry(self, direction: str, num_bytes: int) -> None:
        """Block until `num_bytes` have crossed `direction`, after whatever is queued on it."""
        rate = self.rate(direction)
        with self.lock:
            self.bytes[direction] += num_bytes
            if rate <= 0 or num_bytes <= 0:
                return
            now = self.clock()
            duration = num_bytes / rate
            end = max(now, self.free_at[direction]) + duration
            self.free_at[direction] = end
            self.busy_s[direction] += duration
            self.waited_s[direction] += end - now
        wait = end - self.clock()
        if wait > 0:
            self.sleep(wait)

    def snapshot(self) -> dict[str, float]:
        """Bytes and seconds per direction, and the number of requests, for a report."""
        with self.lock:
            return {"bytes_up": self.bytes[UP], "bytes_down": self.bytes[DOWN], "busy_up_s": self.busy_s[UP],
                    "busy_down_s": self.busy_s[DOWN], "waited_up_s": self.waited_s[UP],
                    "waited_down_s": self.waited_s[DOWN], "requests": self.requests}


class ThrottledStore(WrapperStore):
    """Forwards to `inner` through `link` (a LinkSpec, or a Link to share with another view)."""

    def __init__(self, inner: Store, link: LinkSpec | Link) -> None:
        super().__init__(inner)
        self.link = link if isinstance(link, Link) else Link(link)

    def _over(self, inner: Store) -> ThrottledStore:
        return ThrottledStore(inner, self.link)

    def __repr__(self) -> str:
        s = self.link.spec
        return (f"ThrottledStore({self.inner!r}, up={s.up_bytes_per_s:g} B/s, "
                f"down={s.down_bytes_per_s:g} B/s, rtt={s.rtt_s:g} s)")

    def get(self, key: str) -> bytes:
        self.link.round_trip()
        data = self.inner.get(key)
        self.link.carry(DOWN, len(data))
        return data

    def put(self, key: str, data: bytes) -> None:
        self.link.carry(UP, len(data))  # the object exists in the bucket once it has been sent
        self.link.round_trip()
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self.link.carry(UP, len(data))
        self.link.round_trip()
        self.inner.put_if_absent(key, data)

    def list(self, prefix: str, after: str = "") -> list[str]:
        self.link.round_trip()
        keys = self.inner.list(prefix, after)
        self.link.carry(DOWN, sum(len(k) + 1 for k in keys))  # the listing's body: about its keys
        return keys

    def folders(self, prefix: str) -> list[str]:
        self.link.round_trip()
        names = self.inner.folders(prefix)
        self.link.carry(DOWN, sum(len(prefix) + len(n) + 2 for n in names))
        return names

    def get_size(self, key: str) -> int:
        self.link.round_trip()
        return self.inner.get_size(key)

    def modified(self, key: str) -> float:
        self.link.round_trip()
        return self.inner.modified(key)

    def exists(self, key: str) -> bool:
        self.link.round_trip()
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self.link.round_trip()
        self.inner.delete(key)

"""A fragmented learner's one poll: a thread that reads every merger shard's heads (diloco.storage.heads)
each learner.prefetch_poll_s and wakes the lane prefetchers whose chain moved past what they hold, so P lanes
cost one small GET a poll (per merger shard) instead of P; each lane still polls by itself every
learner.prefetch_idle_poll_s in case the heads are missing or stale.

Contract: it only wakes (Prefetcher.expect), once per new head; it never fetches, installs or raises:
unreadable heads are no news.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from diloco.learner.prefetch import Prefetcher
from diloco.storage import RunKeys
from diloco.storage.heads import read_heads
from diloco.storage.store import Store

# a lane polls its own chain every this many heads polls when learner.prefetch_idle_poll_s is unset
IDLE_POLLS = 20


class HeadsWatcher:
    """A daemon thread polling the heads of `shards` merger shards every `poll_s` for `prefetchers` (chain
    index -> its lane's Prefetcher)."""

    def __init__(self, store: Store, keys: RunKeys, prefetchers: Mapping[int, Prefetcher], shards: int,
                 poll_s: float, name: str) -> None:
        self.store, self.keys, self.prefetchers = store, keys, dict(prefetchers)
        self.shards, self.poll_s = shards, poll_s
        self.woken: dict[int, int] = {}  # chain -> the head it last woke its prefetcher for
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heads-{name}", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def poll(self) -> None:
        """One read of every shard's heads; the prefetchers of chains with a newer head than they hold (and
        than this watcher last woke them for) are woken."""
        self.polls += 1
        for shard in range(self.shards):
            for index, version in (read_heads(self.store, self.keys, shard) or {}).items():
                prefetcher = self.prefetchers.get(index)
                if prefetcher is None or version <= max(prefetcher.base, self.woken.get(index, -1)):
                    continue
                self.woken[index] = version
                prefetcher.expect(version)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

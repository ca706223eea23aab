"""Background publishing: deltas (then the checkpoint that follows them) uploaded in seq order.

Contract: the next phase computes while uploads run; a delta is retried until it lands or the
publisher is closed; time the caller waits for a full queue is returned as stall. A checkpoint
(diloco.learner.checkpoint.CheckpointUpload: its moments' spool files, then its pointer) follows its delta,
and only a delta that landed; it may also be queued on its own (`submit_checkpoint`): it never waits for room,
and one waits at most (a newer replaces it, whose files are dropped).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from diloco.learner.checkpoint import CheckpointUpload
from diloco.run.events import EventLog
from diloco.storage import Conflict, StorageError
from diloco.storage.errors import Backoff
from diloco.storage.store import Store

log = logging.getLogger("diloco.publisher")
MAX_PENDING = 2  # deltas in flight before the learner stalls: overlap one phase, never pile up
FIRST_BACKOFF_S = 0.1  # the first wait before an upload is retried; doubled up to max_backoff_s, jittered


class Publisher:
    """One upload thread per learner; FIFO, so deltas land in seq order."""

    def __init__(self, store: Store, events: EventLog, max_backoff_s: float = 5.0,
                 on_landed: Callable[[int, int | None], None] | None = None) -> None:
        self.store, self.events, self.max_backoff_s = store, events, max_backoff_s
        # called with a delta's (seq, fragment) once it has landed (the local spool drops it)
        self.on_landed = on_landed
        self._queue: queue.Queue = queue.Queue()
        self._room = threading.Condition()  # guards _in_flight: deltas submitted, not landed (or given up)
        self._in_flight = 0
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()
        self.bytes_published = 0
        self.fenced = threading.Event()  # another process published one of our seqs: we must stop
        self._checkpoint_alone: CheckpointUpload | None = None  # guarded by _room

    def full(self, coming: int = 0) -> bool:
        """MAX_PENDING deltas are waiting (storage down or slow), counting `coming` more the caller will
        submit (a fragmented learner's deltas still being encoded): a new one would stall the caller."""
        with self._room:
            return self._in_flight + coming >= MAX_PENDING

    def submit(self, key: str, data: bytes, *, seq: int, checkpoint: CheckpointUpload | None = None,
               sidecar: tuple[str, bytes] | None = None, fragment: int | None = None) -> float:
        """Queue a delta (and the checkpoint to write after it; and its signature, written before it;
        `fragment`: its chain, None for the root's); returns seconds stalled waiting for room."""
        t0 = time.time()
        with self._room:
            self._room.wait_for(lambda: self._in_flight < MAX_PENDING)
            self._in_flight += 1
        stall = time.time() - t0
        self._queue.put((key, data, seq, checkpoint, True, sidecar, fragment))
        return stall

    def requeue(self, key: str, data: bytes, *, seq: int, sidecar: tuple[str, bytes] | None = None,
                fragment: int | None = None) -> None:
        """Queue a delta of a previous process (the local spool at a resume) without waiting for room:
        it was already counted against the queue's bound before the crash."""
        self._queue.put((key, data, seq, None, False, sidecar, fragment))

    def submit_checkpoint(self, checkpoint: CheckpointUpload) -> None:
        """Queue a checkpoint on its own (after everything queued before it), without waiting for room: a
        fragmented learner's, when the delta it would follow waits. One waits at most: a newer one replaces it
        (in an outage a checkpoint a cycle never piles up; the replaced one's files are dropped)."""
        with self._room:
            waiting, self._checkpoint_alone = self._checkpoint_alone, checkpoint
        if waiting is not None:
            waiting.discard()
        else:
            self._queue.put(("checkpoint",))

    def drain(self, timeout_s: float = 600.0) -> bool:
        """Wait until everything queued has landed."""
        deadline = time.time() + timeout_s
        while self._queue.unfinished_tasks and time.time() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self, timeout_s: float = 60.0) -> None:
        self.drain(timeout_s)
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout=5)

    def abandon(self) -> None:
        """Stop now and land nothing more: what a crash does (tests, and the local spool keeps the rest)."""
        self._closing.set()
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            if item == ("checkpoint",):
                with self._room:
                    alone, self._checkpoint_alone = self._checkpoint_alone, None
                try:
                    if alone is not None:
                        self._upload_checkpoint(alone)
                finally:
                    self._queue.task_done()
                continue
            key, data, seq, checkpoint, counted, sidecar, fragment = item
            try:
                # the signature lands first (a plain put: it is not history), so the merger never sees the
                # delta without it
                signed = sidecar is None or self._put_with_retry(*sidecar)
                if signed and self._put_with_retry(key, data, exclusive=True):
                    self.bytes_published += len(data)
                    self.events.emit("published", key=key, seq=seq, bytes=len(data))
                    if self.on_landed is not None:
                        self.on_landed(seq, fragment)
                    if checkpoint is not None:
                        self._upload_checkpoint(checkpoint)
                        checkpoint = None
            finally:
                if checkpoint is not None:  # its delta did not land: nothing to point at
                    checkpoint.discard()
                if counted:
                    with self._room:
                        self._in_flight -= 1
                        self._room.notify()
                self._queue.task_done()

    def _upload_checkpoint(self, checkpoint: CheckpointUpload) -> None:
        checkpoint.upload(self.store, lambda key, data: self._put_with_retry(key, data, attempts=3),
                          self.events)

    def _landed(self, key: str, data: bytes) -> bool:
        try:
            return self.store.get(key) == data
        except StorageError:
            return False

    def _put_with_retry(self, key: str, data: bytes, attempts: int | None = None,
                        exclusive: bool = False) -> bool:
        backoff, n = Backoff(FIRST_BACKOFF_S, self.max_backoff_s, jitter=True), 0
        while not self._closing.is_set() and not self.fenced.is_set():
            try:
                if exclusive:
                    self.store.put_if_absent(key, data)
                else:
                    self.store.put(key, data)
                return True
            except Conflict:
                if self._landed(key, data):
                    return True  # an earlier attempt (or a process before a restart) landed these very bytes
                log.error("%s already exists: another process publishes as this learner; stopping", key)
                self.events.emit("fenced", key=key)
                self.fenced.set()
                return False
            except StorageError as err:
                n += 1
                if attempts is not None and n >= attempts:
                    log.warning("giving up on %s after %d attempts: %s", key, n, err)
                    return False
                wait_s = backoff.next_s()
                log.warning("upload of %s failed (%s); retrying in %.1fs", key, err, wait_s)
                self.events.emit("publish_retry", key=key, reason=str(err))
                time.sleep(wait_s)
        return False


def deferral(publisher: Publisher, unmerged: int, cfg, coming: int = 0) -> str | None:
    """Why a due delta should wait (its progress ships with a later one), or None: "uploading" when
    MAX_PENDING deltas are in flight (counting `coming` the caller will submit), "unmerged" when `unmerged` of
    the learner's deltas (on this chain) are shipped and not decided yet by the version it holds:
    learner.max_unmerged (`cfg`: the learner config), the back-pressure of a merger that cannot keep up."""
    if publisher.full(coming):
        return "uploading"
    if cfg.max_unmerged and unmerged >= cfg.max_unmerged:
        return "unmerged"
    return None

"""Background publishing: deltas (then the checkpoint that follows them) uploaded in seq order.

Contract: the next phase computes while uploads run; a delta is retried until it lands or the
publisher is closed; time the caller waits for a full queue is returned as stall. A checkpoint
(diloco.learner.checkpoint.CheckpointUpload: its moments' spool files, then its pointer) follows its delta,
and only a delta that landed; it may also be queued on its own (`submit_checkpoint`): it never waits for room,
and one waits at most (a newer replaces it, whose files are dropped). A delta whose slot holds another object
(diloco.learner.slots) has landed (the same bytes), stops the learner (a twin: another process publishes
under its name; `fenced`, `stop_reason`), or ships at the next free seq (a planted object; a `slot_taken`
event; at most MAX_MOVES slots on), and the chain's later deltas after it (`next_seq`: where the learner's
next delta goes).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from diloco.learner.checkpoint import CheckpointUpload
from diloco.learner.slots import MAX_MOVES, Holder, Slots
from diloco.run.events import EventLog
from diloco.storage import Conflict, StorageError
from diloco.storage.errors import Backoff
from diloco.storage.store import Store

log = logging.getLogger("diloco.publisher")
T = TypeVar("T")
MAX_PENDING = 2  # deltas in flight before the learner stalls: overlap one phase, never pile up
FIRST_BACKOFF_S = 0.1  # the first wait before an upload is retried; doubled up to max_backoff_s, jittered


class Publisher:
    """One upload thread per learner; FIFO, so deltas land in seq order."""

    def __init__(self, store: Store, events: EventLog, slots: Slots, max_backoff_s: float = 5.0,
                 on_landed: Callable[[int, int | None], None] | None = None) -> None:
        self.store, self.events, self.max_backoff_s = store, events, max_backoff_s
        self.slots = slots  # the learner's delta keys, its process id, who holds a taken one
        # called with a delta's (seq, fragment) once it has landed (the local spool drops it)
        self.on_landed = on_landed
        self._queue: queue.Queue = queue.Queue()
        self._room = threading.Condition()  # guards _in_flight: deltas submitted, not landed (or given up)
        self._in_flight = 0
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()
        self.bytes_published = 0
        # another process published one of our seqs (or no slot was free): the learner stops
        self.fenced = threading.Event()
        self.stop_reason = ""
        # per chain (fragment; None: the root's), guarded by _room: one past the seq its last delta landed
        # at, and its deltas queued and not landed (or given up)
        self._floor: dict[int | None, int] = {}
        self._pending: dict[int | None, int] = {}
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
            self._pending[fragment] = self._pending.get(fragment, 0) + 1
        stall = time.time() - t0
        self._queue.put((key, data, seq, checkpoint, True, sidecar, fragment))
        return stall

    def requeue(self, key: str, data: bytes, *, seq: int, sidecar: tuple[str, bytes] | None = None,
                fragment: int | None = None) -> None:
        """Queue a delta of a previous process (the local spool at a resume) without waiting for room:
        it was already counted against the queue's bound before the crash."""
        with self._room:
            self._pending[fragment] = self._pending.get(fragment, 0) + 1
        self._queue.put((key, data, seq, None, False, sidecar, fragment))

    def next_seq(self, fragment: int | None, seq: int) -> int:
        """The seq the chain's next delta takes, where the lane's counter says `seq`: past the seqs its
        queued deltas will land at once a slot was taken (they follow the moved one), else `seq`. Called
        with every delta taken from the lane submitted."""
        with self._room:
            floor = self._floor.get(fragment)
            return seq if floor is None else max(seq, floor + self._pending.get(fragment, 0))

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
            landed = None
            try:
                landed = self._publish(key, data, seq, sidecar, fragment)
                if landed is not None:
                    if self.on_landed is not None:
                        self.on_landed(seq, fragment)
                    if checkpoint is not None:
                        self._upload_checkpoint(checkpoint)
                        checkpoint = None
            finally:
                if checkpoint is not None:  # its delta did not land: nothing to point at
                    checkpoint.discard()
                with self._room:
                    self._pending[fragment] -= 1
                    if landed is not None:
                        self._floor[fragment] = landed + 1
                    if counted:
                        self._in_flight -= 1
                        self._room.notify()
                self._queue.task_done()

    def _publish(self, key: str, data: bytes, seq: int, sidecar: tuple[str, bytes] | None,
                 fragment: int | None) -> int | None:
        """Land delta `seq` at its slot, or past slots others took (the chain's floor first): the seq it
        landed at, or None (closing, fenced, or no free slot within MAX_MOVES)."""
        with self._room:
            target = max(seq, self._floor.get(fragment, seq))
        moves = 0
        while True:
            if target != seq:
                key, sent, signature = self.slots.moved(data, fragment, target)
            else:
                sent, signature = data, sidecar
            outcome = self._land(key, sent, signature)
            if outcome == "":
                return None
            holder = Holder("ours") if outcome == "landed" else \
                self._retrying(functools.partial(self.slots.holder, fragment, target, sent, signature))
            if holder is None:
                return None
            if holder.kind == "ours":
                self.bytes_published += len(sent)
                moved = {} if target == seq else {"moved_from": seq}
                self.events.emit("published", key=key, seq=target, bytes=len(sent), **moved)
                return target
            if holder.kind == "twin":
                return self._stop(key, "fenced", f"{key} already exists: another process publishes as this "
                                  f"learner ({holder.reason}); stopping")
            if holder.kind != "free":
                moves += 1
                self._taken(key, target, seq, holder, fragment)
                if moves > MAX_MOVES:
                    return self._stop(key, "slots_exhausted", f"no free slot for delta {seq}: {moves} slots "
                                      f"up to {key} hold objects this learner did not write; stopping")
                target += 1

    def _land(self, key: str, data: bytes, sidecar: tuple[str, bytes] | None) -> str:
        """"landed", "taken" (the key holds an object) or "" (closing, fenced). The signature lands first (a
        plain put: it is not history), so the merger never sees the delta without it; with signing on a held
        key is looked at before (the holder's own signature is what tells a twin from a planted object)."""
        if sidecar is not None:
            held = self._retrying(lambda: self.store.exists(key))
            if held is None:
                return ""
            if held:
                return "taken"
        if sidecar is not None and not self._put_with_retry(*sidecar):
            return ""
        return self._put_with_retry(key, data, exclusive=True)

    def _taken(self, key: str, target: int, seq: int, holder: Holder, fragment: int | None) -> None:
        if holder.kind == "planted":
            log.warning("%s holds an object this learner did not write (%s); the delta ships at the next "
                        "free seq", key, holder.reason)
        self.events.emit("slot_taken", key=key, seq=target, delta_seq=seq, holder=holder.kind,
                         reason=holder.reason, **({} if fragment is None else {"fragment": fragment}))

    def _stop(self, key: str, event: str, why: str) -> None:
        log.error("%s", why)
        self.stop_reason = why
        self.events.emit(event, key=key, reason=why)
        self.fenced.set()
        return None

    def _retrying(self, fn: Callable[[], T]) -> T | None:
        """fn() retried through storage trouble; None once closing or fenced."""
        backoff = Backoff(FIRST_BACKOFF_S, self.max_backoff_s, jitter=True)
        while not self._closing.is_set() and not self.fenced.is_set():
            try:
                return fn()
            except StorageError as err:
                wait_s = backoff.next_s()
                log.warning("reading a delta's slot failed (%s); retrying in %.1fs", err, wait_s)
                time.sleep(wait_s)
        return None

    def _upload_checkpoint(self, checkpoint: CheckpointUpload) -> None:
        checkpoint.upload(self.store, lambda key, data: self._put_with_retry(key, data, attempts=3),
                          self.events)

    def _put_with_retry(self, key: str, data: bytes, attempts: int | None = None, exclusive: bool = False):
        """True once landed, False after `attempts` or once closing; exclusive: "landed", "taken" (Conflict:
        the caller looks at the holder) or ""."""
        backoff, n = Backoff(FIRST_BACKOFF_S, self.max_backoff_s, jitter=True), 0
        while not self._closing.is_set() and not self.fenced.is_set():
            try:
                if exclusive:
                    self.store.put_if_absent(key, data)
                    return "landed"
                self.store.put(key, data)
                return True
            except Conflict:
                return "taken"
            except StorageError as err:
                n += 1
                if attempts is not None and n >= attempts:
                    log.warning("giving up on %s after %d attempts: %s", key, n, err)
                    return False
                wait_s = backoff.next_s()
                log.warning("upload of %s failed (%s); retrying in %.1fs", key, err, wait_s)
                self.events.emit("publish_retry", key=key, reason=str(err))
                time.sleep(wait_s)
        return "" if exclusive else False


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

"""Fetching a newer global: the compact updates (or the full params when far behind), on the training thread
(`fetch_global`) or ahead of it in a background thread (`Prefetcher`, `learner.prefetch`).

Contract: fetch_global(base, glob, version) returns G_version with the exact bits every learner and the
merger hold (G_v = G_{v-1} + decode(update_v); far behind: a checkpoint plus the updates after it); inputs
are not modified. A Prefetcher polls for version base+1, fetches everything up to the newest version and
hands it over with `take()` — the training thread installs without a single request to the bucket; storage
trouble is logged and retried on the next poll, never raised; a corrupt committed object (CorruptObject)
ends the thread and is raised by the next `take()`, on the training thread; `rebase` follows an install
made another way (a sync wait, a resume).
"""

from __future__ import annotations

import logging
import threading

from diloco.run.chain_state import apply_updates, chain_params
from diloco.run.context import RunContext
from diloco.run.objects import CorruptObject
from diloco.storage import Manifest, NotFound, StorageError, latest_version, manifest_exists, read_manifest
from diloco.storage.codec import CodecError
from diloco.storage.store import Store
from diloco.training.tensors import Tensors, clone

log = logging.getLogger("diloco.learner")


def fetch_global(ctx: RunContext, store: Store, base: int, glob: Tensors, version: int,
                 max_updates_behind: int) -> tuple[Tensors, Manifest]:
    """(G_version, version's manifest) from (base, G_base): the updates base+1..version, or — when more than
    `max_updates_behind` behind, or an update is gone (gc's retention) — the checkpoint at or before the
    version and the updates after it (diloco.run.chain_state). StorageError / CodecError from the bucket."""
    if version - base <= max_updates_behind:
        out = clone(glob)
        try:
            return out, apply_updates(ctx, out, base + 1, version, store)
        except NotFound:
            del out
    m = read_manifest(store, ctx.keys, version)
    return chain_params(ctx, m, store=store), m


class Prefetcher:
    """A daemon thread that keeps the newest committed global fetched; `take()` hands it over once."""

    def __init__(self, ctx: RunContext, store: Store, name: str, base: int, glob: Tensors, *,
                 poll_s: float, max_updates_behind: int) -> None:
        self.ctx, self.store, self.name = ctx, store, name
        self.poll_s, self.max_updates_behind = poll_s, max_updates_behind
        self._lock = threading.Lock()
        self._base, self._glob = base, clone(glob)  # the newest version fetched (handed over or not)
        self._ready: tuple[int, Tensors] | None = None
        self._ready_manifest: Manifest | None = None  # the manifest of the version in _ready
        self.taken_manifest: Manifest | None = None  # ... of the version the last take() handed over
        self._stop = threading.Event()
        self._fatal: CorruptObject | None = None  # raised by take(): no retry can fetch past a corrupt object
        self.fetches = 0  # versions fetched (for a report)
        self._thread = threading.Thread(target=self._run, name=f"prefetch-{name}", daemon=True)
        self._thread.start()

    def take(self) -> tuple[int, Tensors] | None:
        """(version, G_version) fetched since the last take, the newest only; None when nothing new.
        `taken_manifest` is then that version's manifest (the run's clock, the learner's cursor). CorruptObject
        when the thread met one."""
        with self._lock:
            if self._fatal is not None:
                raise self._fatal
            ready, self._ready = self._ready, None
            if ready is not None:
                self.taken_manifest = self._ready_manifest
            return ready

    def rebase(self, base: int, glob: Tensors) -> None:
        """The learner moved to `base` by itself: fetch from there (drops an older fetch not taken yet)."""
        with self._lock:
            if base >= self._base:
                self._base, self._glob = base, clone(glob)
                self._ready = None

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll()
            except (StorageError, CodecError) as err:
                log.warning("learner %s: prefetch failed (%s); retrying", self.name, err)
            except CorruptObject as err:
                with self._lock:
                    self._fatal = err
                return
            self._stop.wait(self.poll_s)

    def _poll(self) -> None:
        with self._lock:
            base, glob = self._base, self._glob
        if not manifest_exists(self.store, self.ctx.keys, base + 1):
            return
        latest = latest_version(self.store, self.ctx.keys)
        if latest is None or latest <= base:
            return
        fetched, manifest = fetch_global(self.ctx, self.store, base, glob, latest, self.max_updates_behind)
        with self._lock:
            if self._base != base:  # rebased meanwhile: this fetch builds on an older chain
                return
            self._base, self._glob = latest, fetched
            self._ready, self._ready_manifest = (latest, clone(fetched)), manifest
            self.fetches += latest - base

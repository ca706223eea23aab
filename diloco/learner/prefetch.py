"""Fetching a newer global: the compact updates (or, far behind, a checkpoint and the updates after it), on
the training thread (`fetch_global`, `fetch_spilled`) or ahead of it in a background thread (`Prefetcher`,
`learner.prefetch`).

Contract: fetch_global(base, glob, version) returns G_version with the exact bits every learner and the
merger hold (G_v = G_{v-1} + decode(update_v); far behind: a checkpoint plus the updates after it); inputs
are not modified. fetch_spilled gives the same bits as a spill file (diloco.learner.spill), built one tensor
at a time: the learner never holds a whole G in memory. A Prefetcher polls for version base+1, fetches
everything up to the newest version and hands it over with `take()` — the very file it fetched, no second
copy; it keeps it as the base of its next fetch — so the training thread installs without a single request
to the bucket; storage trouble is logged and retried on the next poll, never raised; a corrupt committed
object (CorruptObject) ends the thread and is raised by the next `take()`, on the training thread; `rebase`
follows an install made another way (a sync wait, a resume). It polls every `idle_poll_s` (default
poll_s), and every `poll_s` from an `expect()` (a HeadsWatcher saw a newer version of its chain) until one
newer than the base then arrives, or EXPECT_POLLS polls passed. A HeadsWatcher reads the heads every merger
shard writes after each commit (the newest version of each chain it owns: one small object, a hint; the
manifests stay the truth) every `poll_s` and wakes the prefetchers whose chain moved: one request a poll for
every lane of a fragmented learner.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping

import torch

from diloco.learner.spill import SpillDir, Spilled, scratch_dir
from diloco.run.chain_state import apply_updates, params_at, version_name
from diloco.run.context import RunContext
from diloco.run.objects import CorruptObject, read_committed_lazy
from diloco.storage import Manifest, NotFound, StorageError, latest_version, manifest_exists, read_manifest
from diloco.storage.codec import CodecError
from diloco.storage.codec.lazy import LazyObject
from diloco.storage.store import Store
from diloco.training.tensors import Tensors, clone

log = logging.getLogger("diloco.learner")
# an expected version is polled for at most this many times at poll_s before idle polling resumes
EXPECT_POLLS = 20


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
    return params_at(ctx, version, store)


class StepGate:
    """A CPU learner's inner steps and its prefetchers' folds never overlap: a step's gradients and
    activations and a fold's tensors (G's, the update's) would add up in memory. A step waits at most one
    tensor's fold; a fold waits for the step (the download itself never waits)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted = threading.Event()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._wanted.set()
        with self._lock:
            self._wanted.clear()
            yield

    @contextlib.contextmanager
    def fold(self) -> Iterator[None]:
        while self._wanted.is_set():  # a step is waiting: it goes first
            time.sleep(0.001)
        with self._lock:
            yield


def fetch_spilled(ctx: RunContext, store: Store, base: int, glob: Mapping[str, torch.Tensor], version: int,
                  max_updates_behind: int, spill: SpillDir,
                  gate: StepGate | None = None) -> tuple[Spilled, Manifest]:
    """fetch_global's (G_version, manifest), G as a spill file: each update base+1..version folded into the
    previous G one tensor at a time (one update's bytes held at once; each tensor's fold inside `gate`), or,
    more than `max_updates_behind` behind, fetch_global's full params written out. `glob` (a spill file or
    tensors) is not modified."""
    if version - base <= max_updates_behind:
        try:
            current = glob
            for v in range(base + 1, version + 1):
                manifest = read_manifest(store, ctx.keys, v)
                what = f"{version_name(ctx, v)}'s update"
                update = read_committed_lazy(store, manifest.update_key, checksum=manifest.update_checksum,
                                             fingerprint=ctx.fingerprint, what=what)
                current = spill.write(_folded(current, update, gate), tag="g")
                del update
            return current, manifest
        except NotFound:  # an update gc's retention removed: from the checkpoint instead
            pass
    params, manifest = params_at(ctx, version, store)
    return spill.write(params.items(), tag="g"), manifest


def _folded(previous: Mapping[str, torch.Tensor], update: LazyObject,
            gate: StepGate | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, G_{v-1}[name] + update_v[name]) one tensor at a time, each made and written inside `gate`."""
    for k in previous:
        with gate.fold() if gate is not None else contextlib.nullcontext():
            value = _fresh(previous, k).add_(torch.from_numpy(update.array(k)))
            yield k, value  # written before the next one is made
            del value


def _fresh(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """Tensor `name` to add into: a spill file's read is fresh already; another mapping's is copied."""
    value = tensors[name]
    return value if isinstance(tensors, Spilled) else value.detach().clone()


class Prefetcher:
    """A daemon thread that keeps the newest committed global fetched; `take()` hands it over once."""

    def __init__(self, ctx: RunContext, store: Store, name: str, base: int,
                 glob: Mapping[str, torch.Tensor], *,
                 poll_s: float, max_updates_behind: int, spill: SpillDir | None = None,
                 gate: StepGate | None = None, idle_poll_s: float | None = None) -> None:
        self.ctx, self.store, self.name = ctx, store, name
        self.poll_s, self.max_updates_behind = poll_s, max_updates_behind
        self.idle_poll_s = poll_s if idle_poll_s is None else max(poll_s, idle_poll_s)
        self._wake = threading.Event()  # expect() or close(): the wait between polls ends now
        # a version > _expect_base is expected for _expect_polls more polls (counted, not timed: a loaded
        # machine's slower polls still make EXPECT_POLLS of them)
        self._expect_base, self._expect_polls = -1, 0
        self._hint: int | None = None  # expect()'s version: fetched to without a probe
        self._last_poll = -float("inf")
        self.polls = 0  # polls made (for a report)
        self.spill = spill or SpillDir(scratch_dir(), persist=False)
        self.gate = gate  # a CPU learner's: folds between its inner steps
        self._lock = threading.Lock()
        # the newest version fetched (handed over or not): a spill file, never changed, shared with the
        # learner
        self._base, self._glob = base, glob
        self._ready: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._ready_manifest: Manifest | None = None  # the manifest of the version in _ready
        self.taken_manifest: Manifest | None = None  # ... of the version the last take() handed over
        self._stop = threading.Event()
        self._fatal: CorruptObject | None = None  # raised by take(): no retry can fetch past a corrupt object
        self.fetches = 0  # versions fetched (for a report)
        self._thread = threading.Thread(target=self._run, name=f"prefetch-{name}", daemon=True)
        self._thread.start()

    def take(self) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """(version, G_version) fetched since the last take, the newest only; None when nothing new.
        `taken_manifest` is then that version's manifest (the run's clock, the learner's cursor).
        CorruptObject when the thread met one."""
        with self._lock:
            if self._fatal is not None:
                raise self._fatal
            ready, self._ready = self._ready, None
            if ready is not None:
                self.taken_manifest = self._ready_manifest
            return ready

    def rebase(self, base: int, glob: Mapping[str, torch.Tensor]) -> None:
        """The learner moved to `base` by itself: fetch from there (drops an older fetch not taken yet).
        `glob` (a spill file, which never changes) is shared, not copied."""
        with self._lock:
            if base >= self._base:
                self._base, self._glob = base, glob
                self._ready = None

    def expect(self, version: int | None = None) -> None:
        """A version newer than the base is there or due: poll now, then every poll_s until one arrives or
        EXPECT_POLLS polls passed. `version`: the version said to be there (a heads object's): the next poll
        fetches up to it without a probe or a listing (a version that is not there: the usual poll after)."""
        with self._lock:
            self._expect_base, self._expect_polls = self._base, EXPECT_POLLS
            self._last_poll = -float("inf")
            self._hint = version
        self._wake.set()

    @property
    def base(self) -> int:
        """The newest version fetched (or rebased to)."""
        with self._lock:
            return self._base

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def _until_next_poll(self) -> float:
        """Seconds until the next poll: poll_s apart while a version is expected, else idle_poll_s apart."""
        with self._lock:
            expected = self._base <= self._expect_base and self._expect_polls > 0
            return self._last_poll + (self.poll_s if expected else self.idle_poll_s) - time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            wait_s = self._until_next_poll()
            if wait_s > 0:
                self._wake.wait(wait_s)
                self._wake.clear()
                continue
            with self._lock:
                self._last_poll = time.monotonic()
                self._expect_polls = max(0, self._expect_polls - 1)
            self.polls += 1
            try:
                self._poll()
            except (StorageError, CodecError) as err:
                log.warning("learner %s: prefetch failed (%s); retrying", self.name, err)
            except CorruptObject as err:
                with self._lock:
                    self._fatal = err
                return

    def _poll(self) -> None:
        with self._lock:
            base, glob, hint, self._hint = self._base, self._glob, self._hint, None
        if hint is not None and hint > base:  # said to be there: its manifests are read, no probe, no listing
            try:
                self._fetched(base, glob, hint)
                return
            except NotFound:  # not there (stale or false heads): look for what is
                pass
        if not manifest_exists(self.store, self.ctx.keys, base + 1):
            return
        latest = latest_version(self.store, self.ctx.keys, after=base)  # what is new: not the whole chain
        if latest is None or latest <= base:
            return
        self._fetched(base, glob, latest)

    def _fetched(self, base: int, glob: Mapping[str, torch.Tensor], latest: int) -> None:
        """Fetch base -> latest and make it the next take() (unless rebased meanwhile)."""
        fetched, manifest = fetch_spilled(self.ctx, self.store, base, glob, latest, self.max_updates_behind,
                                          self.spill, self.gate)
        with self._lock:
            if self._base != base:  # rebased meanwhile: this fetch builds on an older chain
                return
            self._base, self._glob = latest, fetched  # handed over and kept: the same file, one G
            self._ready, self._ready_manifest = (latest, fetched), manifest
            self.fetches += latest - base

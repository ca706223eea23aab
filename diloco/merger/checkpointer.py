"""The checkpoints a merger writes of the chains it holds: every `state.checkpoint_every` versions (K), the
chains of a fragmented run taking turns (fragment p on the grid shifted by p·K/P), in the background, one at
a time per merger process (`CheckpointWriter`), and named by the chain's next manifest once landed.

Contract: a chain's checkpoint of version v is started only after v is committed (so it is the chain's
state, and records v's manifest checksum), from the tensors the merger holds: the next merge's step (which
changes them in place) waits until every part's bytes are built (`before_step`), never for the puts. A
manifest names the newest checkpoint landed before its commit (never one older than its parent names): so
v − checkpoint(v) stays under K plus the rounds a write takes, and never passes 2K (K_MAX_FACTOR): past it
the merger waits for the write in flight, or writes one itself before it steps. A write that fails on
storage is logged and tried again at the next version; any other error is raised on the merger's thread at
its next look.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from diloco.configs import checkpoint_every
from diloco.run.checkpoint import manifest_checksum, write_checkpoint
from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.storage import Manifest, StorageError
from diloco.storage.manifest import CheckpointRef
from diloco.training.outer import OuterState
from diloco.training.tensors import Tensors

log = logging.getLogger("diloco.merger")
Held = tuple[Manifest, Tensors, OuterState | None, dict]  # a merger's held state: what a checkpoint writes
K_MAX_FACTOR = 2  # a manifest's checkpoint is never more than this many times K behind it


class CheckpointWriter:
    """The one thread of a merger process that writes its chains' checkpoints, one after another."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, job: Callable[[], CheckpointRef]) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        return self._pool.submit(job)

    def close(self) -> None:
        """Wait for the checkpoints in flight to land (or fail)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _newer(a: CheckpointRef | None, b: CheckpointRef | None) -> CheckpointRef | None:
    if a is None or (b is not None and b.version > a.version):
        return b
    return a


class ChainCheckpoints:
    """One chain's checkpoints, as its merger writes and names them."""

    def __init__(self, ctx: RunContext, writer: CheckpointWriter, merger_id: str, events: EventLog,
                 stage_hook: Callable[[str], None] | None = None) -> None:
        self.ctx, self.writer, self.merger_id, self.events = ctx, writer, merger_id, events
        self.every = checkpoint_every(ctx.cfg)
        # the chains take turns: fragment p of P checkpoints on the grid shifted by p * K // P, so a merger
        # that owns every chain builds one chain's parts at a time (while P <= K), not P at once
        self.offset = (ctx.keys.fragment or 0) * self.every // max(1, ctx.cfg.fragments.count)
        self.stage_hook = stage_hook
        self.named: CheckpointRef | None = None  # what the newest manifest names (or a newer one found)
        self._job: Future | None = None
        self._job_version = -1
        self._free = threading.Event()  # set while no job reads the held tensors
        self._free.set()

    def reset(self, ref: CheckpointRef | None) -> None:
        """The chain's newest checkpoint as a (re)load found it (the newest manifest's, or a newer one)."""
        self.named = _newer(self.named, ref)

    def landed(self) -> CheckpointRef | None:
        """The newest checkpoint this merger landed (its job done); raises the job's error if it was no
        storage trouble (a bug is never swallowed on the writer's thread)."""
        job = self._job
        if job is None or not job.done():
            return None
        self._job = None
        try:
            ref = job.result()
        except StorageError as err:
            log.warning("run %s: checkpoint of version %d failed on storage (%s); tried again at the next "
                        "version", self.ctx.run_id, self._job_version, err)
            self.events.emit("checkpoint_failed", version=self._job_version, reason=str(err)[:300])
            return None
        self.named = _newer(self.named, ref)
        return ref

    def ref_for(self, version: int) -> CheckpointRef:
        """What manifest `version` names: the newest checkpoint landed so far (never newer than it)."""
        self.landed()
        if self.named is None or self.named.version > version:
            raise RuntimeError(f"run {self.ctx.run_id}: no checkpoint at or before version {version} to name")
        return self.named

    def before_step(self, version: int, held: Callable[[], Held]) -> None:
        """Before the step of the merge that makes `version` changes the held tensors: wait until a job
        copying them is done with them; and when `version` would be more than K_MAX_FACTOR x K past the
        newest checkpoint, wait for the job in flight to land, or write one of the held state now."""
        self._free.wait()
        self.landed()
        if self.named is not None and version - self.named.version <= K_MAX_FACTOR * self.every:
            return
        if self._job is not None:
            self._job.exception()  # wait for it: landed() takes its result
            self.landed()
        if self.named is None or version - self.named.version > K_MAX_FACTOR * self.every:
            manifest, params, outer, ema = held()
            t0 = time.perf_counter()
            self.named = self._write(manifest, params, outer, ema)
            log.info("run %s: checkpoint of version %d written before merging on (%.1f s)", self.ctx.run_id,
                     manifest.version, time.perf_counter() - t0)

    def after_commit(self, manifest: Manifest, params: Tensors, outer: OuterState | None, ema: dict) -> None:
        """Version `manifest` is committed and held: start its checkpoint when K versions passed since the
        newest."""
        self.landed()
        newest = self.named.version if self.named is not None else 0
        if self._job is not None or self._slot(manifest.version) <= self._slot(newest):
            return
        self._free.clear()
        self._job_version = manifest.version
        try:
            self._job = self.writer.submit(lambda: self._write(manifest, params, outer, ema))
        except BaseException:
            self._free.set()
            raise

    def _slot(self, version: int) -> int:
        """Which of the chain's checkpoint intervals `version` is in (a new one is due in the next)."""
        return (version + self.offset) // self.every

    def _write(self, manifest: Manifest, params: Tensors, outer: OuterState | None,
               ema: dict) -> CheckpointRef:
        try:
            t0 = time.perf_counter()
            ref = write_checkpoint(self.ctx, manifest.version, params, outer, ema=ema,
                                   manifest_checksum=manifest_checksum(self.ctx, manifest.version),
                                   created_by=self.merger_id, stage_hook=self.stage_hook,
                                   on_encoded=self._free.set)
            self.events.emit("checkpoint", version=manifest.version, key=ref.key,
                             write_s=time.perf_counter() - t0, fragment=self.ctx.keys.fragment)
            return ref
        finally:
            self._free.set()

    def wait(self) -> None:
        """Until the job in flight is done with the held tensors (a reload replaces them)."""
        self._free.wait()

    def flush(self) -> CheckpointRef | None:
        """Wait for the checkpoint in flight to land (or fail); the newest the chain can name."""
        if self._job is not None:
            self._job.exception()
        self.landed()
        return self.named

"""A learner: inner AdamW steps on its own shard, ship-and-carry deltas, install newer versions.

Contract (DESIGN §5): shipped + carried = all local progress. A delta is `r - theta`; after
shipping, `r -= dequantize(delta)` (error feedback); on a newer global `G`, `theta = G + (theta - r)`
and `r = G`. The learner never waits for anyone, except in `sync` mode, the synchronous oracle.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator

import torch

from diloco.learner.courier import Courier
from diloco.learner.local_state import LocalState
from diloco.learner.pace import Pace
from diloco.learner.phase_stats import PhaseStats
from diloco.learner.prefetch import Prefetcher, fetch_global
from diloco.learner.publisher import Publisher, deferral
from diloco.learner.ranks import build_trainer, lead_step
from diloco.learner.resume import resume
from diloco.learner.state import QUICK_RETRIES, LearnerState
from diloco.learner.world import CLOCK, FULL, PARAMS, RESET, STOP, World, slice_batch
from diloco.run.buffers import install_buffers
from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.run.objects import encode_shipped, encode_tensors, read_committed
from diloco.run.spec import load_run_spec
from diloco.storage import Manifest, StorageError, latest_version, manifest_exists, read_latest
from diloco.storage.codec import CodecError
from diloco.storage.records import LearnerStatus, write_record
from diloco.training.buffers import get_buffers, set_buffers
from diloco.training.data import shard_of
from diloco.training.inner import pick_device
from diloco.training.model import get_flat_params, set_params
from diloco.training.spec import SpecError, TrainSpec
from diloco.training.tensors import Tensors, add_, clone, sub
from diloco.trust.signing import learner_key, sign

log = logging.getLogger("diloco.learner")
HEARTBEAT_EVERY_S = 2.0  # status.json refresh while training; the supervisor's timeout is far longer


class Learner:
    """One island of compute. Drive it with join(), then run_phase() + publish() in a loop."""

    def __init__(self, ctx: RunContext, name: str, spec: TrainSpec | None = None, *,
                 events: EventLog | None = None, slowdown: float | None = None, world: World | None = None,
                 signing_key: bytes | None = None) -> None:
        self.ctx, self.name, self.cfg = ctx, name, ctx.cfg
        # learner.sign: every delta is signed with this learner's key (trust/signing.py; never from the bucket)
        self.signing_key = signing_key or (learner_key() if self.cfg.learner.sign else None)
        self.device = pick_device(self.cfg.learner.device)
        torch.set_num_threads(self.cfg.learner.num_threads)  # one failure domain, one core by default
        self.spec = spec or load_run_spec(ctx)
        self.events = events or EventLog(None, None, name)
        self.slowdown = slowdown or 1.0  # heterogeneous hardware (a chaos plan's `slow` fault): steps take this x longer
        # whether the run has ended (diloco.run.signals.RoleStop; set by run_learner): checked at each probe, so a
        # phase ends within probe_every_steps of the run's end instead of training on to its H
        self.stop_check: Callable[[], bool] | None = None
        self.local = None
        if self.cfg.learner.local_state_every_steps > 0:
            self.local = LocalState(ctx.store.url, ctx.run_id, name, ctx.created_at, ctx.fingerprint)
        self.quick = ctx.store.with_retries(QUICK_RETRIES)
        self.courier = Courier(f"courier-{name}")  # statuses and event flushes, off the training thread
        # its compute speed (every status reports it) and, with inner.dylu, its H from its peers' (diloco.learner.pace)
        self.pace = Pace(self.quick, ctx.keys, name, list(ctx.learners), self.cfg.inner.steps_per_phase,
                         enabled=self.cfg.inner.dylu, timeout_s=self.cfg.run.heartbeat_timeout_s)
        self.publisher = Publisher(ctx.store, self.events, on_landed=self.local.unspool if self.local else None)
        self.world = world  # a multi-rank learner's process group (this is rank 0); None: one process
        self.model, self.trainer = build_trainer(self, world)
        self.shard, self.num_shards = shard_of(name, ctx.learners)
        self.cursor = 0  # batches of this learner's shard consumed so far (what a resume continues from)
        self._batches: Iterator | None = None  # the spec's batches from `cursor`, opened at join
        self.state = LearnerState()
        self.prefetcher: Prefetcher | None = None  # learner.prefetch: newer globals fetched off the training thread
        # inner.schedule_clock "run" before the first step (tokens per step unknown): (tokens_total, own step)
        self._clock_pending: tuple[int, int] | None = None
        self.loss_ema = float("nan")
        self.phase_t0 = time.time()
        self._last_beat = 0.0

    def _open_batches(self) -> None:
        try:
            self._batches = iter(self.spec.batches(self.shard, self.num_shards, self.cursor))
        except Exception as err:  # noqa: BLE001 - user code
            raise SpecError(f"batches({self.shard}, {self.num_shards}, {self.cursor}) failed: "
                            f"{type(err).__name__}: {err}") from err

    # ---- join / rejoin -------------------------------------------------------------------
    def join(self) -> int:
        """Resume (diloco.learner.resume: this host's local state when it is current, else the newest committed
        version with the bucket checkpoint's optimizer state and data cursor); returns the base version."""
        resumed = resume(self.ctx, self.name, local=self.local, events=self.events, set_theta=self._set_theta,
                         import_optimizer=self._import_optimizer, requeue=self._requeue,
                         use_checkpoint=self.cfg.learner.checkpoint,
                         set_buffers=lambda values: set_buffers(self.model, values, self.ctx.buffers))
        self.state, self.cursor = resumed.state, resumed.cursor
        if resumed.tokens_total is not None:  # the run's clock as the resume read it (taken at the first step);
            self.run_clock(resumed.tokens_total)  # none in an outage: the own step count until an install
        self._open_batches()
        if self.world is not None:
            self.world.pending |= FULL  # the other ranks take parameters, optimizer state, step and cursor
        self.events.emit("join", learner=self.name, version=self.state.base, seq=self.state.seq,
                         cursor=resumed.cursor, step=resumed.step, **resumed.extra)
        self.heartbeat("joined", force=True, wait=True)  # the supervisor reads it to see the join
        if self.cfg.learner.prefetch and self.cfg.learner.mode != "sync" and self.prefetcher is None:
            self.prefetcher = Prefetcher(self.ctx, self.ctx.store, self.name, self.state.base, self.state.glob,
                                         poll_s=self.cfg.learner.prefetch_poll_s,
                                         max_updates_behind=self.cfg.learner.max_updates_behind)
        log.info("learner %s joined at version %d, next seq %d, data cursor %d, step %d %s", self.name,
                 self.state.base, self.state.seq, resumed.cursor, resumed.step, resumed.extra or "")
        return self.state.base

    def _import_optimizer(self, tensors: Tensors, meta: dict) -> int:
        self.trainer.import_state(tensors, meta)
        return self.trainer.step

    def _requeue(self, seq: int, data: bytes) -> None:
        self.publisher.requeue(self.ctx.keys.delta(self.name, seq), data, seq=seq, sidecar=self._signature(seq, data))

    def _signature(self, seq: int, data: bytes) -> tuple[str, bytes] | None:
        """(key, bytes) of the delta's signature object when signing is on."""
        if self.signing_key is None:
            return None
        return self.ctx.keys.signature(self.name, seq), sign(self.signing_key, self.ctx.run_id, self.name, seq, data)

    def save_local(self, exported: tuple[Tensors, dict] | None = None) -> None:
        """Snapshot the whole state (copies; `exported`: the optimizer state already copied) and queue
        its write to this host (diloco.learner.local_state: encoded and written off the training thread)."""
        if self.local is None:
            return
        opt, opt_meta = exported or self.trainer.export_state()
        meta = {"learner": self.name, "step": self.trainer.step, "cursor": self.cursor,
                "optimizer": opt_meta, **self.state.meta()}
        self.local.save({"theta": self.theta(), "ref": clone(self.state.ref), "glob": self.state.glob, "opt": opt,
                         "buffers": get_buffers(self.model, self.ctx.buffers)}, meta)

    def heartbeat(self, state: str = "training", force: bool = False, wait: bool = False, **phase: float) -> None:
        """Refresh learners/<me>/status.json (at most every HEARTBEAT_EVERY_S unless forced);
        `phase` sets LearnerStatus fields (the per-phase figures after a phase). Written by the courier
        thread unless `wait`: the status is taken now, so a stuck training thread still goes silent."""
        now = time.time()
        if not force and now - self._last_beat < HEARTBEAT_EVERY_S:
            return
        self._last_beat = now
        status = LearnerStatus.model_validate({
            "learner": self.name, "state": state, "t": now, "pid": os.getpid(), "seq": self.state.seq - 1,
            "base_version": self.state.base, "step": self.trainer.step, "cursor": self.cursor,
            "loss": self.loss_ema, "bytes_published": self.publisher.bytes_published,
            **self.pace.status(), "unmerged": self.state.reported_unmerged(),
            **({"ranks": self.world.size, "rank_pids": self.world.pids} if self.world else {}), **phase})
        key = self.ctx.keys.status(self.name)

        def write() -> None:
            try:
                write_record(self.quick, key, status)
            except StorageError as err:
                log.warning("heartbeat of %s failed: %s", self.name, err)

        if wait:
            write()
        else:
            self.courier.post("status", write)

    def next_phase_steps(self) -> int:
        """The next phase's length: H, or inner.dylu's H_w from this learner's speed and its peers' (Pace)."""
        return self.pace.next_steps(self.events)

    def flush_events(self) -> None:
        """Write the buffered events from the courier thread (EventLog keeps them if the write fails)."""
        self.courier.post("events", self.events.flush)

    def _set_theta(self, theta: Tensors) -> None:
        set_params(self.model, theta)

    def theta(self) -> Tensors:
        return get_flat_params(self.model)

    # ---- the inner phase -----------------------------------------------------------------
    def run_phase(self, num_steps: int | None = None) -> PhaseStats:
        """H inner steps (or `num_steps`: a shorter first phase, a per-learner H), probing for a newer global
        version every few steps. A non-finite training loss abandons the phase: its progress never reaches a
        merge (see abandon_phase)."""
        cfg = self.cfg
        num_steps = num_steps or cfg.inner.steps_per_phase
        stats = PhaseStats()
        t0 = time.time()
        losses = []
        every = cfg.learner.local_state_every_steps
        done = 0
        for i in range(num_steps):
            ts = time.time()
            if self.world is not None:
                lead_step(self)
            batch = self._next_batch()
            try:
                with stats.timed("compute_s"):
                    losses.append(self.trainer.train_step(batch))
            except FloatingPointError as err:
                return self.abandon_phase(stats, t0, str(err))
            if self._clock_pending is not None:
                self.run_clock(*self._clock_pending)
            self.state.steps_since_publish += 1
            self.state.tokens_since_publish += self.trainer.last_tokens
            stats.tokens += self.trainer.last_tokens
            if self.slowdown > 1.0:
                with stats.timed("compute_s"):  # slower hardware: its steps take longer
                    time.sleep((time.time() - ts) * (self.slowdown - 1.0))
            self.heartbeat()
            done = i + 1
            if self.run_ended_at(done):
                break  # the phase ends here, its steps are shipped
            # with a prefetcher, taking what it fetched costs no request: a newer global is installed at the
            # first step after it arrived, not up to probe_every_steps later (measured: docs/bench/wan.md)
            probe = self.prefetcher is not None or done % cfg.learner.probe_every_steps == 0
            if probe and cfg.learner.mode != "sync":
                with stats.timed("install_s"):
                    installed = self.maybe_install()
                if installed is not None:
                    stats.installs.append(installed)
            if every and done % every == 0 and done < num_steps and not self.local.writing():
                # the phase's end is saved by publish(); skipped while the last save is still being written
                # (at 124M parameters a save is ~2.5 GB: a GPU learner's 10 steps take far less than writing it)
                with stats.timed("save_s"):
                    self.save_local()
        stats.steps = done
        stats.loss = sum(losses) / len(losses)
        stats.phase_time_s = time.time() - t0
        self.loss_ema = stats.loss
        self.events.emit("phase", learner=self.name, version=self.state.base, steps=stats.steps,
                         tokens=stats.tokens, t_start=t0, duration_s=stats.phase_time_s, loss=stats.loss,
                         **stats.times())
        return stats

    def run_ended_at(self, step_in_phase: int) -> bool:
        """At a probe (every learner.probe_every_steps steps of a phase): whether the run has ended (target,
        stop, removal: stop_check), so the phase ends there instead of training on to its H."""
        return (step_in_phase % self.cfg.learner.probe_every_steps == 0 and self.stop_check is not None
                and self.stop_check())

    def _next_batch(self) -> object:
        if self._batches is None:
            self._open_batches()
        try:
            batch = next(self._batches)
        except StopIteration:
            raise SpecError(f"batches({self.shard}, {self.num_shards}, ...) ran out at batch {self.cursor}: "
                            "it must yield batches for as long as the run trains") from None
        self.cursor += 1
        return batch if self.world is None else slice_batch(batch, 0, self.world.size)

    def abandon_phase(self, stats: PhaseStats, t0: float, reason: str) -> PhaseStats:
        """A non-finite loss: nothing of this learner's unshipped progress may reach a merge. Drop it, reset
        the optimizer's state (its moments may be poisoned), and rejoin at the newest version (full params);
        seq, step and data cursor go on. Recorded as a `phase_failed` event with the reason."""
        log.warning("learner %s: %s; the phase is abandoned and the learner rejoins the newest version",
                    self.name, reason)
        self.events.emit("phase_failed", learner=self.name, version=self.state.base, reason=reason[:300],
                         unshipped_steps=self.state.steps_since_publish, t_start=t0)
        manifest = read_latest(self.ctx.store, self.ctx.keys)
        _, glob = read_committed(self.ctx.store, manifest.params_key, fingerprint=self.ctx.fingerprint,
                                 checksum=manifest.params_checksum, what=f"version {manifest.version}'s params")
        self._set_theta(clone(glob))
        install_buffers(self.ctx, self.model, manifest)  # a NaN may have reached the running statistics too
        self.trainer.reset_optimizer()
        if self.world is not None:
            self.world.pending |= PARAMS | RESET
        self.state = LearnerState.at_version(manifest.version, glob, self.state.seq, manifest.cursors.get(self.name, -1))
        self.run_clock(manifest.tokens_total)
        if self.prefetcher is not None:
            self.prefetcher.rebase(manifest.version, glob)
        stats.phase_time_s, stats.tokens = time.time() - t0, 0
        return stats

    # ---- ship ----------------------------------------------------------------------------
    def publish(self, stats: PhaseStats | None = None) -> int | None:
        """Ship r - theta as delta `seq`; keep the quantization error in r (error feedback).
        Nothing is published (None) when no step was taken since the last delta, or (not in sync mode) when
        MAX_PENDING deltas are still uploading or learner.max_unmerged are not merged yet: what is in r - theta
        ships with the next one."""
        cfg, state = self.cfg, self.state
        if state.steps_since_publish == 0:
            return None
        reason = None if cfg.learner.mode == "sync" else deferral(self.publisher, state.unmerged(), cfg.learner)
        if reason is not None:
            # train on rather than wait: the progress stays in r - theta and ships with the next delta (steps add up)
            self.events.emit("publish_deferred", learner=self.name, seq=state.seq, steps=state.steps_since_publish,
                             reason=reason, unmerged=state.unmerged())
            self.save_local()
            return None
        started = time.time()
        delta = sub(state.ref, self.theta())
        seq = state.seq
        meta = {
            "learner": self.name, "seq": seq, "base_version": state.base,
            "tokens": state.tokens_since_publish, "steps": state.steps_since_publish,
            "phase_time_s": time.time() - self.phase_t0, "train_loss": self.loss_ema,
            "created_at": time.time(),
        }
        data, shipped = encode_shipped(delta, codec_name=cfg.learner.codec, kind="delta",
                                       fingerprint=self.ctx.fingerprint, meta=meta, shuffle=cfg.learner.shuffle,
                                       buffers=get_buffers(self.model, self.ctx.buffers))  # its own, exactly
        add_(state.ref, shipped, alpha=-1.0)
        # one copy of the optimizer state for both snapshots (encoders only read it)
        exported = self.trainer.export_state() if cfg.learner.checkpoint or self.local is not None else None
        checkpoint = (self.ctx.keys.checkpoint(self.name, "state"), self._checkpoint(seq, exported)) \
            if cfg.learner.checkpoint else None
        if self.local is not None:
            self.local.spool(seq, data)  # until it lands: a crash while the bucket is away loses nothing
        stall = self.publisher.submit(self.ctx.keys.delta(self.name, seq), data, seq=seq, checkpoint=checkpoint,
                                      sidecar=self._signature(seq, data))
        state.shipped()
        self.phase_t0 = time.time()
        self.save_local(exported)
        if stats is not None:
            stats.seq, stats.stall_s, stats.delta_bytes = seq, stall, len(data)
        self.events.emit("publish", learner=self.name, seq=seq, version=state.base, bytes=len(data),
                         tokens=meta["tokens"], steps=meta["steps"], stall_s=stall,
                         duration_s=round(time.time() - started, 4))
        return seq

    def _checkpoint(self, seq: int, exported: tuple[Tensors, dict]) -> Callable[[], bytes]:
        """The bucket checkpoint after delta `seq`: the state copied now, encoded by the publisher's thread."""
        tensors, opt_meta = exported
        meta = {"learner": self.name, "seq": seq, "step": self.trainer.step, "cursor": self.cursor,
                "base_version": self.state.base, "optimizer": opt_meta}
        return lambda: encode_tensors(tensors, codec_name="fp32", kind="state",
                                        fingerprint=self.ctx.fingerprint, meta=meta)

    # ---- carry ---------------------------------------------------------------------------
    def maybe_install(self) -> int | None:
        """Cheap probe for version base+1; on a newer version install it and return it. With a prefetcher:
        install what it fetched (no request to the bucket on this thread)."""
        if self.prefetcher is not None:
            fetched = self.prefetcher.take()
            return None if fetched is None else self.install(*fetched, manifest=self.prefetcher.taken_manifest)
        try:
            if not manifest_exists(self.quick, self.ctx.keys, self.state.base + 1):
                return None
            latest = latest_version(self.ctx.store, self.ctx.keys)
            if latest is None or latest <= self.state.base:
                return None
            return self.install(latest)
        except (StorageError, CodecError) as err:
            log.warning("learner %s: probe/install failed (%s); training on", self.name, err)
            self.events.emit("install_failed", learner=self.name, version=self.state.base, reason=str(err))
            return None

    def install(self, version: int, glob: Tensors | None = None, manifest: Manifest | None = None) -> int:
        """Move to `version` (`glob`: G_version already fetched, `manifest` its manifest): theta = G +
        (theta - r) (carry) or G (overwrite); r = G. With inner.schedule_clock "run", the schedule moves to the
        run's clock."""
        state = self.state
        behind = version - state.base
        if glob is None:
            glob, manifest = fetch_global(self.ctx, self.ctx.store, state.base, state.glob, version,
                                          self.cfg.learner.max_updates_behind)
        theta = self.theta()
        if self.cfg.learner.mode == "overwrite":
            new_theta = clone(glob)
        else:
            new_theta = {k: glob[k] + (theta[k] - state.ref[k]) for k in glob}
        self._set_theta(new_theta)
        if self.world is not None:
            self.world.pending |= PARAMS
        self.events.emit("install", learner=self.name, version=version, previous=state.base, behind=behind)
        state.base, state.glob, state.ref = version, glob, clone(glob)
        if manifest is not None:
            state.merged = manifest.cursors.get(self.name, -1)
            self.run_clock(manifest.tokens_total)
        if self.prefetcher is not None:
            self.prefetcher.rebase(version, glob)
        return version

    def run_clock(self, tokens_total: int, at_step: int | None = None) -> None:
        """inner.schedule_clock "run": put the schedule at the run's step, `tokens_total` (merged into the version
        installed at own step `at_step`, default now) / (learners x this learner's tokens per step), plus the own
        steps since; it advances one per own step from here. Only merged tokens count: no guess at the steps in
        flight (adding this learner's unshipped steps for every learner's was 0.3% worse on the hetero row,
        docs/bench/quality.md). Before the learner's first step (tokens per step unknown: a join) the clock is kept
        for then."""
        if self.cfg.inner.schedule_clock != "run":
            return
        at_step = self.trainer.step if at_step is None else at_step
        tokens_per_step = self.trainer.last_tokens
        if tokens_per_step <= 0:
            self._clock_pending = (tokens_total, at_step)
            return
        self._clock_pending = None
        run_step = round(tokens_total / (max(len(self.ctx.learners), 1) * tokens_per_step))
        self.trainer.set_clock(run_step + self.trainer.step - at_step)
        if self.world is not None:
            self.world.pending |= CLOCK

    def wait_for_decision(self, seq: int, timeout_s: float, should_stop=lambda: False) -> int | None:
        """Sync mode: block until a version decides delta `seq`, then install it."""
        self.publisher.drain()
        deadline = time.time() + timeout_s
        while time.time() < deadline and not should_stop():
            self.heartbeat("waiting")
            try:
                m = read_latest(self.ctx.store, self.ctx.keys)
                if m is not None and m.cursors.get(self.name, -1) >= seq:
                    return self.install(m.version) if m.version > self.state.base else self.state.base
            except StorageError as err:
                log.warning("learner %s: waiting for version failed (%s)", self.name, err)
            time.sleep(self.cfg.merger.poll_interval_s)
        return None

    def close(self, timeout_s: float = 60.0) -> None:
        if self.world is not None:
            self.world.control(STOP)
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.publisher.close(timeout_s)
        if self.local is not None:
            self.local.close()
        self.courier.close()
        self.events.emit("stop", learner=self.name, seq=self.state.seq, version=self.state.base)
        self.events.flush()

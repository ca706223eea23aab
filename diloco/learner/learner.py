"""A learner: inner AdamW steps on its own shard, ship-and-carry deltas, install newer versions.

Contract (DESIGN §5): shipped + carried = all local progress. A delta is `r - theta`; after
shipping, `r -= dequantize(delta)` (error feedback); on a newer global `G`, `theta = G + (theta - r)`
and `r = G`. The learner never waits for anyone, except in `sync` mode, the synchronous oracle.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diloco.learner.courier import Courier
from diloco.learner.local_state import LocalState, Saved
from diloco.learner.publisher import Publisher
from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.run.objects import decode_tensors, encode_tensors, read_tensors
from diloco.storage import (
    Manifest,
    NotFound,
    StorageError,
    latest_version,
    manifest_exists,
    read_latest,
    read_manifest,
)
from diloco.storage.codec import CodecError
from diloco.storage.keys import parse_delta_key
from diloco.storage.records import LearnerStatus, write_record
from diloco.training.data import Corpus, ShardSampler, shard_of
from diloco.training.inner import InnerTrainer
from diloco.training.model import build_model, get_flat_params, set_params
from diloco.training.tensors import Tensors, add_, clone, sub

log = logging.getLogger("diloco.learner")
HEARTBEAT_EVERY_S = 2.0  # status.json refresh while training; the supervisor's timeout is far longer
QUICK_RETRIES = 1  # probes and heartbeats on the training thread: one quick retry, then train on (next one soon)


@dataclass
class PhaseStats:
    seq: int = -1
    steps: int = 0
    tokens: int = 0
    loss: float = float("nan")
    phase_time_s: float = 0.0
    stall_s: float = 0.0
    installs: list[int] = field(default_factory=list)
    delta_bytes: int = 0


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("learner.device is 'cuda' but no CUDA device is available")
    return name


class Learner:
    """One island of compute. Drive it with join(), then run_phase() + publish() in a loop."""

    def __init__(self, ctx: RunContext, name: str, corpus: Corpus, *, events: EventLog | None = None,
                 slowdown: float | None = None) -> None:
        self.ctx, self.name, self.cfg = ctx, name, ctx.cfg
        self.device = pick_device(self.cfg.learner.device)
        torch.set_num_threads(self.cfg.learner.num_threads)  # one failure domain, one core by default
        self.corpus = corpus
        self.events = events or EventLog(None, None, name)
        self.slowdown = slowdown or 1.0  # heterogeneous hardware (a chaos plan's `slow` fault): steps take this x longer
        self.local = None
        if self.cfg.learner.local_state_every_steps > 0:
            self.local = LocalState(ctx.store.url, ctx.run_id, name, ctx.created_at, ctx.fingerprint)
        self.quick = ctx.store.with_retries(QUICK_RETRIES)
        self.courier = Courier(f"courier-{name}")  # statuses and event flushes, off the training thread
        self.publisher = Publisher(ctx.store, self.events, on_landed=self.local.unspool if self.local else None)
        self.model = build_model(self.cfg.model, seed=self.cfg.data.seed).to(self.device)
        self.base = -1
        self.seq = 0
        self.glob: Tensors = {}
        self.ref: Tensors = {}
        self.tokens_since_publish = 0
        self.steps_since_publish = 0
        self.loss_ema = float("nan")
        self.phase_t0 = time.time()
        self._last_beat = 0.0

    # ---- join / rejoin -------------------------------------------------------------------
    def join(self) -> int:
        """Resume from this host's local state when it is current; else start from the newest committed
        version, resuming optimizer state and data cursor from the bucket's checkpoint."""
        saved = self.local.load() if self.local else None
        if saved is not None and self._resume_local(saved):
            return self.base
        manifest = read_latest(self.ctx.store, self.ctx.keys)
        if manifest is None:
            raise RuntimeError(f"run {self.ctx.run_id} has no committed version")
        self._load_full(manifest)
        self._set_theta(clone(self.glob))
        self.seq = self._next_seq(manifest)
        self.trainer = InnerTrainer(self.model, self.cfg.inner, device=self.device)
        step, cursor = self._restore_checkpoint()
        self._joined(cursor, step)
        return self.base

    def _joined(self, cursor: int, step: int, **extra: object) -> None:
        shard, num_shards = shard_of(self.name, self.ctx.learners)
        self.sampler = ShardSampler(
            self.corpus.train, shard, num_shards, self.cfg.data.batch_size, self.cfg.model.ctx_len,
            self.cfg.data.seed, cursor=cursor,
        )
        self.events.emit("join", learner=self.name, version=self.base, seq=self.seq, cursor=cursor, step=step,
                         **extra)
        self.heartbeat("joined", force=True, wait=True)  # the supervisor reads it to see the join
        log.info("learner %s joined at version %d, next seq %d, data cursor %d, step %d %s",
                 self.name, self.base, self.seq, cursor, step, extra or "")

    def _resume_local(self, saved: Saved) -> bool:
        """Continue from the local state (no download): True, or False (state cleared) when the bucket
        has moved past it — a seq of ours listed or decided beyond it. Without the bucket (an outage)
        the state is trusted: the publisher's exclusive create still fences a duplicate."""
        meta = saved.meta
        next_seq = int(meta["next_seq"])
        try:
            manifest = read_latest(self.ctx.store, self.ctx.keys)
            bucket_next = self._next_seq(manifest) if manifest is not None else 0
        except StorageError as err:
            log.warning("learner %s: bucket unreachable (%s); resuming from local state unchecked", self.name, err)
            bucket_next = None
        if bucket_next is not None and bucket_next > next_seq:
            log.info("learner %s: local state (next seq %d) is behind the bucket (%d); dropped",
                     self.name, next_seq, bucket_next)
            self.local.clear()
            return False
        self.trainer = InnerTrainer(self.model, self.cfg.inner, device=self.device)
        try:
            self.trainer.import_state(saved.parts["opt"], meta.get("optimizer") or {})
            self._set_theta(saved.parts["theta"])
        except (ValueError, KeyError, RuntimeError) as err:
            log.warning("learner %s: local state does not fit (%s); dropped", self.name, err)
            self.local.clear()
            return False
        self.glob, self.ref, self.base, self.seq = saved.parts["glob"], saved.parts["ref"], int(meta["base_version"]), next_seq
        self.steps_since_publish = int(meta.get("steps_since_publish", 0))
        self.tokens_since_publish = int(meta.get("tokens_since_publish", 0))
        requeued = []
        for seq, data in self.local.spooled():
            if seq >= next_seq:  # written just before a crash that the state does not include: redone
                self.local.unspool(seq)
            elif bucket_next is None or seq >= bucket_next:
                self.publisher.requeue(self.ctx.keys.delta(self.name, seq), data, seq=seq)
                requeued.append(seq)
            else:
                self.local.unspool(seq)  # listed or decided already
        self._joined(int(meta["cursor"]), self.trainer.step, local=True, requeued=requeued,
                     unshipped_steps=self.steps_since_publish)
        return True

    def save_local(self, exported: tuple[Tensors, dict] | None = None) -> None:
        """Snapshot the whole state (copies; `exported`: the optimizer state already copied) and queue
        its write to this host (diloco.learner.local_state: encoded and written off the training thread)."""
        if self.local is None:
            return
        opt, opt_meta = exported or self.trainer.export_state()
        meta = {"learner": self.name, "next_seq": self.seq, "base_version": self.base, "step": self.trainer.step,
                "cursor": self.sampler.cursor, "optimizer": opt_meta, "steps_since_publish": self.steps_since_publish,
                "tokens_since_publish": self.tokens_since_publish}
        self.local.save({"theta": self.theta(), "ref": clone(self.ref), "glob": self.glob, "opt": opt}, meta)

    def _next_seq(self, manifest: Manifest) -> int:
        listed = [parse_delta_key(k) for k in self.ctx.store.list(self.ctx.keys.deltas_prefix(self.name))]
        seqs = [p[1] for p in listed if p and p[0] == self.name]
        return max([*seqs, manifest.cursors.get(self.name, -1)]) + 1

    def _restore_checkpoint(self) -> tuple[int, int]:
        if not self.cfg.learner.checkpoint:
            return 0, 0
        try:
            header, state = read_tensors(self.ctx.store, self.ctx.keys.checkpoint(self.name, "state"))
        except NotFound:
            return 0, 0
        except (CodecError, StorageError) as err:
            log.warning("learner %s: checkpoint unreadable (%s); starting fresh state", self.name, err)
            self.events.emit("checkpoint_unreadable", learner=self.name, reason=str(err))
            return 0, 0
        meta = header.meta
        try:
            self.trainer.import_state(state, meta.get("optimizer") or {})
        except ValueError as err:
            log.warning("learner %s: checkpoint does not fit (%s); starting fresh state", self.name, err)
            self.events.emit("checkpoint_unreadable", learner=self.name, reason=str(err))
            return 0, 0
        self.events.emit("resume", learner=self.name, step=meta.get("step"), cursor=meta.get("cursor"),
                         checkpoint_seq=meta.get("seq"))
        return int(meta.get("step", 0)), int(meta.get("cursor", 0))

    def _load_full(self, manifest: Manifest) -> None:
        _, params = read_tensors(self.ctx.store, manifest.params_key, fingerprint=self.ctx.fingerprint,
                                   checksum=manifest.params_checksum)
        self.glob = params
        self.ref = clone(params)
        self.base = manifest.version

    def heartbeat(self, state: str = "training", force: bool = False, wait: bool = False, **phase: float) -> None:
        """Refresh learners/<me>/status.json (at most every HEARTBEAT_EVERY_S unless forced);
        `phase` sets LearnerStatus fields (the per-phase figures after a phase). Written by the courier
        thread unless `wait`: the status is taken now, so a stuck training thread still goes silent."""
        now = time.time()
        if not force and now - self._last_beat < HEARTBEAT_EVERY_S:
            return
        self._last_beat = now
        status = LearnerStatus.model_validate({
            "learner": self.name, "state": state, "t": now, "pid": os.getpid(), "seq": self.seq - 1,
            "base_version": self.base, "step": self.trainer.step, "cursor": self.sampler.cursor,
            "loss": self.loss_ema, "bytes_published": self.publisher.bytes_published, **phase})
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

    def flush_events(self) -> None:
        """Write the buffered events from the courier thread (EventLog keeps them if the write fails)."""
        self.courier.post("events", self.events.flush)

    def _set_theta(self, theta: Tensors) -> None:
        set_params(self.model, theta)

    def theta(self) -> Tensors:
        return get_flat_params(self.model)

    # ---- the inner phase -----------------------------------------------------------------
    def run_phase(self) -> PhaseStats:
        """H inner steps, probing for a newer global version every few steps."""
        cfg = self.cfg
        stats = PhaseStats()
        t0 = time.time()
        losses = []
        tokens_per_step = cfg.data.batch_size * cfg.model.ctx_len
        every = cfg.learner.local_state_every_steps
        for i in range(cfg.inner.steps_per_phase):
            ts = time.time()
            x, y = self.sampler.next_batch()
            losses.append(self.trainer.train_step(x.to(self.device), y.to(self.device)))
            self.steps_since_publish += 1
            self.tokens_since_publish += tokens_per_step
            if self.slowdown > 1.0:
                time.sleep((time.time() - ts) * (self.slowdown - 1.0))
            self.heartbeat()
            if (i + 1) % cfg.learner.probe_every_steps == 0 and cfg.learner.mode != "sync":
                installed = self.maybe_install()
                if installed is not None:
                    stats.installs.append(installed)
            if every and (i + 1) % every == 0 and i + 1 < cfg.inner.steps_per_phase:
                self.save_local()  # the phase's end is saved by publish()
        stats.steps = cfg.inner.steps_per_phase
        stats.tokens = stats.steps * tokens_per_step
        stats.loss = sum(losses) / len(losses)
        stats.phase_time_s = time.time() - t0
        self.loss_ema = stats.loss
        self.events.emit("phase", learner=self.name, version=self.base, steps=stats.steps,
                         tokens=stats.tokens, t_start=t0, duration_s=stats.phase_time_s, loss=stats.loss)
        return stats

    # ---- ship ----------------------------------------------------------------------------
    def publish(self, stats: PhaseStats | None = None) -> int | None:
        """Ship r - theta as delta `seq`; keep the quantization error in r (error feedback).
        Nothing is published (None) when no step was taken since the last delta, or when MAX_PENDING
        deltas are still uploading (not in sync mode): what is in r - theta ships with the next one."""
        cfg = self.cfg
        if self.steps_since_publish == 0:
            return None
        if cfg.learner.mode != "sync" and self.publisher.full():
            # Storage down or slow: train on rather than wait. Nothing is shipped now; the progress stays
            # in r - theta and ships with the next delta (one delta, its steps and tokens add up).
            self.events.emit("publish_deferred", learner=self.name, seq=self.seq, steps=self.steps_since_publish)
            self.save_local()
            return None
        delta = sub(self.ref, self.theta())
        seq = self.seq
        meta = {
            "learner": self.name, "seq": seq, "base_version": self.base,
            "tokens": self.tokens_since_publish, "steps": self.steps_since_publish,
            "phase_time_s": time.time() - self.phase_t0, "train_loss": self.loss_ema,
            "created_at": time.time(),
        }
        data = encode_tensors(delta, codec_name=cfg.learner.codec, kind="delta",
                                fingerprint=self.ctx.fingerprint, meta=meta, shuffle=cfg.learner.shuffle)
        _, shipped = decode_tensors(data)
        add_(self.ref, shipped, alpha=-1.0)
        # one copy of the optimizer state for both snapshots (encoders only read it)
        exported = self.trainer.export_state() if cfg.learner.checkpoint or self.local is not None else None
        checkpoint = (self.ctx.keys.checkpoint(self.name, "state"), self._checkpoint(seq, exported)) \
            if cfg.learner.checkpoint else None
        if self.local is not None:
            self.local.spool(seq, data)  # until it lands: a crash while the bucket is away loses nothing
        stall = self.publisher.submit(self.ctx.keys.delta(self.name, seq), data, seq=seq, checkpoint=checkpoint)
        self.seq += 1
        self.tokens_since_publish = 0
        self.steps_since_publish = 0
        self.phase_t0 = time.time()
        self.save_local(exported)
        if stats is not None:
            stats.seq, stats.stall_s, stats.delta_bytes = seq, stall, len(data)
        self.events.emit("publish", learner=self.name, seq=seq, version=self.base, bytes=len(data),
                         tokens=meta["tokens"], steps=meta["steps"], stall_s=stall)
        return seq

    def _checkpoint(self, seq: int, exported: tuple[Tensors, dict]) -> Callable[[], bytes]:
        """The bucket checkpoint after delta `seq`: the state copied now, encoded by the publisher's thread."""
        tensors, opt_meta = exported
        meta = {"learner": self.name, "seq": seq, "step": self.trainer.step, "cursor": self.sampler.cursor,
                "base_version": self.base, "optimizer": opt_meta}
        return lambda: encode_tensors(tensors, codec_name="fp32", kind="state",
                                        fingerprint=self.ctx.fingerprint, meta=meta)

    # ---- carry ---------------------------------------------------------------------------
    def maybe_install(self) -> int | None:
        """Cheap probe for version base+1; on a newer version install it and return it."""
        try:
            if not manifest_exists(self.quick, self.ctx.keys, self.base + 1):
                return None
            latest = latest_version(self.ctx.store, self.ctx.keys)
            if latest is None or latest <= self.base:
                return None
            return self.install(latest)
        except (StorageError, CodecError) as err:
            log.warning("learner %s: probe/install failed (%s); training on", self.name, err)
            self.events.emit("install_failed", learner=self.name, version=self.base, reason=str(err))
            return None

    def install(self, version: int) -> int:
        """Move to `version`: theta = G + (theta - r) (carry) or G (overwrite); r = G."""
        behind = version - self.base
        if behind <= self.cfg.learner.max_updates_behind:
            glob = clone(self.glob)
            for v in range(self.base + 1, version + 1):
                m = read_manifest(self.ctx.store, self.ctx.keys, v)
                _, update = read_tensors(self.ctx.store, m.update_key, fingerprint=self.ctx.fingerprint,
                                           checksum=m.update_checksum)
                add_(glob, update)
        else:
            m = read_manifest(self.ctx.store, self.ctx.keys, version)
            _, glob = read_tensors(self.ctx.store, m.params_key, fingerprint=self.ctx.fingerprint,
                                     checksum=m.params_checksum)
        theta = self.theta()
        if self.cfg.learner.mode == "overwrite":
            new_theta = clone(glob)
        else:
            new_theta = {k: glob[k] + (theta[k] - self.ref[k]) for k in glob}
        self._set_theta(new_theta)
        self.glob, self.ref = glob, clone(glob)
        self.events.emit("install", learner=self.name, version=version, previous=self.base, behind=behind)
        self.base = version
        return version

    def wait_for_decision(self, seq: int, timeout_s: float, should_stop=lambda: False) -> int | None:
        """Sync mode: block until a version decides delta `seq`, then install it."""
        self.publisher.drain()
        deadline = time.time() + timeout_s
        while time.time() < deadline and not should_stop():
            self.heartbeat("waiting")
            try:
                m = read_latest(self.ctx.store, self.ctx.keys)
                if m is not None and m.cursors.get(self.name, -1) >= seq:
                    return self.install(m.version) if m.version > self.base else self.base
            except StorageError as err:
                log.warning("learner %s: waiting for version failed (%s)", self.name, err)
            time.sleep(self.cfg.merger.poll_interval_s)
        return None

    def close(self, timeout_s: float = 60.0) -> None:
        self.publisher.close(timeout_s)
        if self.local is not None:
            self.local.close()
        self.courier.close()
        self.events.emit("stop", learner=self.name, seq=self.seq, version=self.base)
        self.events.flush()

"""Shipping a learner's deltas (a section of diloco.learner.learner.Learner): lane p's `r_p - theta_p`
encoded, its error feedback into r_p, its upload queued, and after fragment 0's delta (the whole model's: each
phase's) the bucket checkpoint (diloco.learner.checkpoint: the pointer, and the moments when due).

Contract: the whole model ships at the end of a phase (publish); with fragments lane p ships at its staggered
step (ship_due) and publish ships nothing. A due delta waits (`publish_deferred`; its progress ships with the
lane's next one) while the publisher is full or learner.max_unmerged of the lane's deltas are not merged yet,
except in sync mode; with fragments the cycle's checkpoint then goes alone (the whole model's waits for its
delta). With learner.encode_in_background (fragments) a delta and its seq are taken at its step and encoded on
the encoder's thread; the training thread completes it (settle) at a later step and before that lane's next
ship or install reads r_p: the same bits as encoding inline. Inline, a delta is encoded one tensor at a time
(r_p - theta_p of one tensor, its stream kept; the dequantized values it ships decoded from the streams for
the error feedback), so no whole-model copy is made. An encode that fails ends the learner. No empty deltas: a
lane with no step since its last delta ships nothing.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from diloco.learner.checkpoint import CheckpointUpload
from diloco.learner.phase_stats import PhaseStats
from diloco.learner.publisher import deferral
from diloco.run.objects import encode_shipped
from diloco.storage import RunKeys, codec
from diloco.training.buffers import get_buffers
from diloco.training.fragments import take
from diloco.training.tensors import Tensors, to_numpy
from diloco.trust.signing import sign


class Shipped(Mapping[str, torch.Tensor]):
    """The values a delta ships, decoded one tensor at a time from the streams its encoder made (what
    decode_tensors gives back from the delta, bit for bit): what the error feedback subtracts from r_p."""

    def __init__(self, encoder: codec.Encoder,
                 streams: dict[str, tuple[tuple[int, ...], np.ndarray]]) -> None:
        self.encoder, self.streams = encoder, streams

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, stream = self.streams[name]
        return torch.from_numpy(self.encoder.shipped(name, shape, stream))

    def __iter__(self) -> Iterator[str]:
        return iter(self.streams)

    def __len__(self) -> int:
        return len(self.streams)


@dataclass
class Shipping:
    """A delta taken from lane `index` as `seq` (its steps, tokens and base version), maybe still encoding."""
    index: int
    seq: int
    steps: int
    tokens: int
    base: int
    stats: PhaseStats | None
    started: float  # when it was taken (the publish event's duration_s)
    future: Future | None = None


class ShipSection:
    """Learner.publish, ship, settle and what they need: deferrals, checkpoints, signatures, requeues."""

    def publish(self, stats: PhaseStats | None = None) -> int | None:
        """The end of a phase. The whole model ships r - theta as delta `seq` (the quantization error stays in
        r: error feedback) and returns it; nothing (None) when no step was taken since the last delta, or (not
        in sync mode) when the publisher is full or learner.max_unmerged deltas are not merged yet: what is in
        r - theta ships with the next one. Fragments ship during the phase: nothing is left (None). The local
        state is saved either way (a fragmented learner's unless this step's is saved already)."""
        if self.whole:
            if self.lanes.lanes[0].steps == 0:
                return None
            if self.defer(0) is None:
                return self.ship(0, stats)  # saves the state after it
            self.save_local()
        elif self.trainer.step != self._saved_step:
            self.save_local()
        return None

    def ship_due(self, stats: PhaseStats) -> None:
        """After a step (fragments): complete the deltas already encoded, then ship every lane due at this
        step (storage slow or down, or the merger behind: it defers, and ships at its next due step)."""
        if self.shipping:
            with stats.timed("ship_s"):
                self.settle(block=False, stats=stats)  # the encodes finished by now: their uploads queued
        for index in self.lanes.due(self.steps_done):
            if self.defer(index) is None:
                with stats.timed("ship_s"):
                    self.ship(index, stats)

    def defer(self, index: int) -> str | None:
        """Why lane `index`'s due delta waits (diloco.learner.publisher.deferral; the deltas still being
        encoded count: each will be submitted), with a `publish_deferred` event; None: it ships. Never in sync
        mode."""
        cfg, lane = self.cfg.learner, self.lanes.lanes[index]
        reason = None if cfg.mode == "sync" else \
            deferral(self.publisher, lane.unmerged(), cfg, coming=len(self.shipping))
        if reason is not None:  # train on rather than wait: the progress stays in r - theta (steps add up)
            self.events.emit("publish_deferred", learner=self.name, **self.tag(index), seq=lane.seq,
                             steps=lane.steps, reason=reason, unmerged=lane.unmerged())
            if index == 0 and not self.whole and self.cfg.learner.checkpoint:  # the cycle's checkpoint, alone
                self.publisher.submit_checkpoint(self._checkpoint(lane.seq - 1, lane.base))
        return reason

    def ship(self, index: int, stats: PhaseStats | None = None) -> int:
        """Ship lane `index`: r_p - theta_p into its chain; keep the quantization error in r_p. The delta is
        taken now; it is encoded here, or on the encoder's thread (learner.encode_in_background) and completed
        at a later step (settle)."""
        cfg, lane = self.cfg, self.lanes.lanes[index]
        self.settle(index, stats=stats)  # the lane's last delta's error feedback is in r_p before r_p is read
        # past the seqs the lane's queued deltas land at, once one of its slots was taken (publisher.next_seq)
        lane.seq = self.publisher.next_seq(self.chain_keys(index).fragment, lane.seq)
        started = time.time()
        meta = {"learner": self.name, "seq": lane.seq, "base_version": lane.base, "tokens": lane.tokens,
                "steps": lane.steps, "phase_time_s": time.time() - self.phase_t0, "train_loss": self.loss_ema,
                "created_at": time.time(), "process": self.publisher.slots.process, **self.tag(index)}
        buffers = get_buffers(self.model, self.ctx.buffers) if index == 0 else None  # its own, exactly
        encode = None
        if self.encoder is None:  # inline, one tensor at a time: a failure leaves the lane as it was
            encoded = self._encode_inline(index, meta, buffers)
        else:  # taken now (training goes on), encoded on the encoder's thread
            encoded = None
            encode = functools.partial(encode_shipped, self.lanes.delta(index, self._live()),
                                       codec_name=cfg.learner.codec, kind="delta",
                                       fingerprint=self.ctx.fingerprint, meta=meta,
                                       shuffle=cfg.learner.shuffle, buffers=buffers)
        seq, steps, tokens = self.lanes.take(index, self.steps_done)
        job = Shipping(index, seq, steps, tokens, lane.base, stats, started)
        if encoded is not None:
            self._complete(job, *encoded, stats)
        else:
            job.future = self.encoder.submit(encode)
            self.shipping.append(job)
        if cfg.learner.mode == "sync" and not self.whole:
            self.awaiting[index] = seq
        if index == len(self.lanes) - 1:
            self.phase_t0 = time.time()
        return seq

    def settle(self, index: int | None = None, block: bool = True, stats: PhaseStats | None = None) -> None:
        """Complete the deltas being encoded, in the order they were taken: all of them, or up to lane
        `index`'s last (waiting for its encode), or (block=False) those already encoded; a stall waiting for
        the publisher counts in `stats` (the phase completing it), else in the phase that took the delta. An
        encode that failed ends the learner (RuntimeError), as it did on the training thread: its seq is
        taken."""
        while self.shipping and (index is None or any(job.index == index for job in self.shipping)):
            job = self.shipping[0]
            if not block and not job.future.done():
                return
            self.shipping.popleft()
            try:
                encoded = job.future.result()
            except Exception as err:  # dropped from the queue first: close() settles the others, then ends
                raise RuntimeError(f"learner {self.name}: encoding fragment {job.index}'s delta seq "
                                   f"{job.seq} failed: {type(err).__name__}: {err}") from err
            self._complete(job, *encoded, stats or job.stats)

    def _encode_inline(self, index: int, meta: dict, buffers: Tensors | None) -> tuple[bytes, Shipped]:
        """encode_shipped of lane `index`'s r_p - theta_p, one tensor at a time (the same bytes and values):
        each tensor's difference made, encoded and dropped; its stream kept for the values shipped
        (Shipped)."""
        cfg, lane = self.cfg.learner, self.lanes.lanes[index]
        part = take(self._live(), lane.fragment, copy=False)
        counted = {"buffers": len(buffers)} if buffers else {}
        encoder = codec.Encoder(codec=cfg.codec, kind="delta", fingerprint=self.ctx.fingerprint,
                                shuffle=cfg.shuffle, meta={**meta, **counted})
        streams: dict[str, tuple[tuple[int, ...], np.ndarray]] = {}
        for k in lane.ref:
            array = (lane.ref[k] - part[k].float()).detach().to("cpu", torch.float32).contiguous().numpy()
            streams[k] = (array.shape, encoder.add(k, array))
            del array
        for name, array in to_numpy(buffers or {}).items():
            encoder.add(name, array, codec="fp32")
        return encoder.finish(), Shipped(encoder, streams)

    def _complete(self, job: Shipping, data: bytes, shipped: Mapping[str, torch.Tensor],
                  stats: PhaseStats | None) -> None:
        """An encoded delta: its error feedback into r_p, the local state saved, its upload queued (spooled
        first; the checkpoint after fragment 0's), its `publish` event. Saved before the upload is queued: a
        delta in the bucket is always in the local state too, so a learner killed at any point after its
        upload lands resumes from this host (a state saved after it could lose the race to a kill, and be
        dropped as behind the bucket); killed between the save and the upload, it ships the spooled delta."""
        self.lanes.feedback(job.index, shipped)
        del shipped
        keys = self.chain_keys(job.index)
        due = self.cfg.learner.checkpoint and job.index == 0
        checkpoint = self._checkpoint(job.seq, job.base) if due else None
        if self.local is not None:  # until it lands: a crash while the bucket is away loses nothing
            self.local.spool(job.seq, data, keys.fragment)
        self.save_local()  # after the spool write (save flushes it), before the upload
        stall = self.publisher.submit(keys.delta(self.name, job.seq), data, seq=job.seq,
                                      checkpoint=checkpoint, sidecar=self._signature(keys, job.seq, data),
                                      fragment=keys.fragment)
        if stats is not None:
            stats.seq, stats.stall_s = job.seq, stats.stall_s + stall
            stats.delta_bytes += len(data)
        self.events.emit("publish", learner=self.name, seq=job.seq, **self.tag(job.index), version=job.base,
                         bytes=len(data), tokens=job.tokens, steps=job.steps, stall_s=stall,
                         duration_s=round(time.time() - job.started, 4))

    def _checkpoint(self, seq: int, base: int) -> CheckpointUpload:
        """The bucket checkpoint after delta `seq` (on version `base`): the pointer, and when
        learner.checkpoint_every says so the moments, encoded now from the live optimizer state into spool
        files (the publisher uploads)."""
        trainer = self.trainer
        return self.checkpointer.make(seq, trainer.step, self.cursor, base, self.checkpointer.due(),
                                      lambda: (trainer.state_tensors(), trainer.state_meta()))

    def _signature(self, keys: RunKeys, seq: int, data: bytes) -> tuple[str, bytes] | None:
        """(key, bytes) of the delta's signature object when signing is on."""
        if self.signing_key is None:
            return None
        return keys.signature(self.name, seq), sign(self.signing_key, self.ctx.run_id, self.name, seq, data)

    def _requeue(self, seq: int, data: bytes, index: int = 0) -> None:
        """A delta of lane `index` spooled by a process before this one (the resume): uploaded again."""
        keys = self.chain_keys(index)
        self.publisher.requeue(keys.delta(self.name, seq), data, seq=seq,
                               sidecar=self._signature(keys, seq, data), fragment=keys.fragment)

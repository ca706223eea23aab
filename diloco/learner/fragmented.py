"""The learner of a fragmented run (fragments.count > 1): inner steps as always, but fragment p ships on its
own staggered schedule into its own chain and a merged fragment is installed when it arrives (lanes).

Contract: per fragment, shipped + carried = all local progress (diloco.learner.lanes); a (re)join starts
every lane at its fragment's newest version with the next unused seq of that chain, and the data cursor and
inner step (the lr schedule) of the learner's last status; `sync` mode waits tau steps after a ship for the
version deciding it. With `learner.prefetch` each lane has its own Prefetcher (a thread on its fragment's chain):
the training thread installs what it fetched at the next step a lane may install, without a request. With
`learner.encode_in_background` (auto: on CUDA) a ship takes the delta and its seq at its step and the encoder's
thread encodes it; the training thread completes it (error feedback, upload, event) at a later step, and before
that lane's next ship or install: the same bits as encoding inline. The buffers the run merges ship with fragment 0's
deltas and are loaded from fragment 0's version at a (re)join. Not supported yet with fragments (refused or off):
learner.ranks > 1, local state, bucket checkpoints.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from diloco.learner.lanes import Lanes
from diloco.learner.learner import Learner, PhaseStats
from diloco.learner.prefetch import Prefetcher, fetch_global
from diloco.learner.publisher import Publisher, deferral
from diloco.run.buffers import install_buffers
from diloco.run.fragments import fragment_context
from diloco.run.objects import encode_shipped, read_committed
from diloco.storage import NotFound, StorageError, latest_version, manifest_exists, read_latest
from diloco.storage.codec import CodecError
from diloco.storage.keys import parse_delta_key
from diloco.storage.records import LearnerStatus, RecordError, read_record
from diloco.training.buffers import get_buffers
from diloco.training.fragments import take
from diloco.training.tensors import Tensors
from diloco.trust.signing import sign

log = logging.getLogger("diloco.learner")


@dataclass
class _Shipping:
    """A delta taken from lane `index` as `seq` (steps, tokens, on version `base`), its encode maybe running."""
    index: int
    seq: int
    steps: int
    tokens: int
    base: int
    stats: PhaseStats | None
    future: Future | None = None


class FragmentLearner(Learner):
    """Drive like a Learner: join(), then run_phase() + publish() in a loop (publish ships nothing more)."""

    def __init__(self, ctx, name, spec=None, **kwargs) -> None:
        super().__init__(ctx, name, spec, **kwargs)
        if self.world is not None:
            raise ValueError("learner.ranks > 1 with fragments.count > 1 is not supported yet")
        if self.local is not None:  # local state saves one whole-model lane: not the fragments' lanes
            self.local.close()
            self.local = None
            self.publisher.close()
            self.publisher = Publisher(ctx.store, self.events)
        self.prefetcher = None  # the whole-model one: never; lanes have their own (lane_prefetch)
        self.lane_prefetch: dict[int, Prefetcher] = {}
        cfg = ctx.cfg
        self.lanes = Lanes(ctx.fragments, cfg.inner.steps_per_phase, cfg.fragments.overlap_steps, cfg.learner.mode)
        # inner.dylu: H_w leaves every fragment its own ship and its overlap in a cycle
        self.pace.min_steps = max(cfg.fragments.overlap_steps + 1, cfg.fragments.count, cfg.fragments.cohorts)
        self.steps_done = 0  # since join, plus the cohort's offset (stagger): the ship schedule counts from here
        self.awaiting: dict[int, int] = {}  # sync mode: lane -> seq waiting for its decision
        # learner.encode_in_background: deltas taken, being encoded on the encoder's thread (FIFO); each completes
        # (error feedback, upload queued, event) on the training thread, before its lane is read again
        background = cfg.learner.encode_in_background
        self.encoder = ThreadPoolExecutor(1, thread_name_prefix=f"encode-{name}") \
            if background is True or (background == "auto" and self.device.startswith("cuda")) else None
        self.shipping: deque[_Shipping] = deque()

    # ---- join ------------------------------------------------------------------------------
    def _live(self) -> Tensors:
        """The model's own parameters (detached views: a lane reads or writes one fragment, never a copy of all)."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def join(self) -> int:
        self.settle()  # a rejoin after a failed phase: what was shipped before it still goes out
        theta, tokens_total = self._live(), 0
        for lane in self.lanes.lanes:
            keys = self.ctx.keys.for_fragment(lane.index)
            manifest = read_latest(self.ctx.store, keys)
            tokens_total = max(tokens_total, manifest.tokens_total)
            _, glob = read_committed(self.ctx.store, manifest.params_key, fingerprint=self.ctx.fingerprint,
                                     checksum=manifest.params_checksum,
                                     what=f"fragment {lane.index}'s version {manifest.version} params")
            self.lanes.join(lane.index, manifest.version, glob, self._next_seq(keys, manifest), theta,
                            manifest.cursors.get(self.name, -1))
            if lane.index == 0:  # the run's buffers ride with fragment 0's chain
                install_buffers(self.ctx, self.model, manifest)
        self.cursor, self.trainer.step = self._last_position()
        self.run_clock(tokens_total)  # inner.schedule_clock "run": the newest fragment's clock
        self._open_batches()
        self.lanes.steps_per_phase, self.lanes.shift = self.cfg.inner.steps_per_phase, 0  # DyLU retimes from here
        self.pace.last_steps = self.cfg.inner.steps_per_phase
        self.steps_done, self.awaiting = self.stagger(), {}
        self._start_prefetch()
        self._sync_state()
        self.events.emit("join", learner=self.name, version=self.state.base, cursor=self.cursor, **self.lanes.meta())
        self.heartbeat("joined", force=True, wait=True)
        log.info("learner %s joined fragments at versions %s, data cursor %d", self.name,
                 self.lanes.meta()["bases"], self.cursor)
        return self.state.base

    def stagger(self) -> int:
        """fragments.cohorts: this learner's schedule offset, (k % cohorts) * H / cohorts steps (k: its place in
        the run's learner list; a name not in it is cohort 0)."""
        cohorts, h = self.cfg.fragments.cohorts, self.cfg.inner.steps_per_phase
        k = self.ctx.learners.index(self.name) if self.name in self.ctx.learners else 0
        return (k % cohorts) * h // cohorts

    def next_phase_steps(self) -> int:
        """inner.dylu: the next phase's H_w, and the lanes retimed to it (their place in the cycle kept)."""
        steps = super().next_phase_steps()
        if steps != self.lanes.steps_per_phase:
            self.lanes.retime(steps, self.steps_done)
        return steps

    def _start_prefetch(self) -> None:
        """learner.prefetch (not in sync mode): one Prefetcher per lane, from the lane's version just joined."""
        self._close_prefetch()
        cfg = self.cfg.learner
        if not cfg.prefetch or cfg.mode == "sync":
            return
        for lane in self.lanes.lanes:
            self.lane_prefetch[lane.index] = Prefetcher(
                fragment_context(self.ctx, lane.index), self.ctx.store, f"{self.name}-f{lane.index}", lane.base,
                lane.glob, poll_s=cfg.prefetch_poll_s, max_updates_behind=cfg.max_updates_behind)

    def _close_prefetch(self) -> None:
        for prefetcher in self.lane_prefetch.values():
            prefetcher.close()
        self.lane_prefetch = {}

    def close(self, timeout_s: float = 60.0) -> None:
        self._close_prefetch()
        try:
            self.settle()  # every delta taken is uploaded, as when it was encoded on the training thread
        finally:
            if self.encoder is not None:
                self.encoder.shutdown(wait=False, cancel_futures=True)
            super().close(timeout_s)

    def drain(self) -> None:
        """Every delta taken encoded and uploaded (tests and tools: the publisher's drain, after the encoder)."""
        self.settle()
        self.publisher.drain()

    def _next_seq(self, keys, manifest) -> int:
        """One past every seq this learner used in the chain: decided (the cursor) or listed (published)."""
        used = manifest.cursors.get(self.name, -1)
        for key in self.ctx.store.list(keys.deltas_prefix(self.name)):
            parsed = parse_delta_key(key)
            if parsed:
                used = max(used, parsed[1])
        return used + 1

    def _last_position(self) -> tuple[int, int]:
        """(data cursor, inner step) of this learner's last status: where its data and its lr schedule go on
        (a rejoin keeps no optimizer moments: fragmented learners write no checkpoints yet)."""
        try:
            status = read_record(self.ctx.store, self.ctx.keys.status(self.name), LearnerStatus)
        except (NotFound, RecordError):
            return self.cursor, self.trainer.step
        return max(self.cursor, status.cursor), max(self.trainer.step, status.step)

    def _sync_state(self) -> None:
        """The whole-learner view the heartbeat reports: the oldest fragment version, the seqs shipped, and (as
        `merged`) the seqs decided, so that state.unmerged() is the lanes' unmerged deltas summed."""
        self.state.base = self.lanes.version()
        self.state.seq = sum(lane.seq for lane in self.lanes.lanes)
        self.state.merged = self.state.seq - 1 - sum(lane.unmerged() for lane in self.lanes.lanes)

    # ---- phase -----------------------------------------------------------------------------
    def run_phase(self, num_steps: int | None = None) -> PhaseStats:
        cfg = self.cfg
        num_steps = num_steps or cfg.inner.steps_per_phase
        stats, t0, losses = PhaseStats(), time.time(), []
        for i in range(num_steps):
            ts = time.time()
            try:
                batch = self._next_batch()
                with stats.timed("compute_s"):
                    losses.append(self.trainer.train_step(batch))
            except FloatingPointError as err:
                log.warning("learner %s: %s; rejoining every fragment's newest version", self.name, err)
                self.events.emit("phase_failed", learner=self.name, version=self.state.base, reason=str(err)[:300])
                self.trainer.reset_optimizer()
                self.join()
                break
            if self.slowdown > 1.0:  # a chaos plan's slow learner: steps take this x longer
                with stats.timed("compute_s"):  # slower hardware: its steps take longer
                    time.sleep((time.time() - ts) * (self.slowdown - 1.0))
            if self._clock_pending is not None:
                self.run_clock(*self._clock_pending)
            self.lanes.stepped(self.trainer.last_tokens)
            self.steps_done += 1
            if self.shipping:
                with stats.timed("ship_s"):
                    self.settle(block=False, stats=stats)  # the encodes finished by now: their uploads queued
            stats.tokens += self.trainer.last_tokens
            stats.steps += 1
            for index in self.lanes.due(self.steps_done):
                # storage slow or down, or the merger behind: train on; the lane keeps its progress and ships it at
                # its next due step (the deltas still being encoded count: each will be submitted)
                lane = self.lanes.lanes[index]
                reason = None if cfg.learner.mode == "sync" else \
                    deferral(self.publisher, lane.unmerged(), cfg.learner, coming=len(self.shipping))
                if reason is not None:
                    self.events.emit("publish_deferred", learner=self.name, fragment=index, seq=lane.seq,
                                     reason=reason, unmerged=lane.unmerged())
                    continue
                with stats.timed("ship_s"):
                    self.ship(index, stats)
            if self.run_ended_at(i + 1):
                break  # what the lanes have not shipped yet stays unshipped: the run is over
            if cfg.learner.mode == "sync":
                self._wait_for_decisions()
            elif self.lane_prefetch or (i + 1) % cfg.learner.probe_every_steps == 0:  # taking a prefetch is free
                with stats.timed("install_s"):
                    stats.installs.extend(self.maybe_install())
            self.heartbeat()
        stats.loss = sum(losses) / len(losses) if losses else float("nan")
        stats.phase_time_s = time.time() - t0
        self.loss_ema = stats.loss
        self.events.emit("phase", learner=self.name, version=self.state.base, steps=stats.steps,
                         tokens=stats.tokens, t_start=t0, duration_s=stats.phase_time_s, loss=stats.loss,
                         **stats.times())
        return stats

    def publish(self, stats: PhaseStats | None = None) -> int | None:
        """Fragments ship during the phase (ship); nothing is left to publish at its end."""
        return None

    def ship(self, index: int, stats: PhaseStats | None = None) -> int:
        """Ship lane `index`: r_p - theta_p into fragment p's chain; keep the quantization error in r_p. The
        delta is taken now; it is encoded here, or on the encoder's thread (learner.encode_in_background) and
        completed at a later step (settle)."""
        cfg, lane = self.cfg, self.lanes.lanes[index]
        self.settle(index, stats=stats)  # the lane's previous delta's error feedback is in r_p before r_p is read
        delta = self.lanes.delta(index, self._live())
        meta = {"learner": self.name, "seq": lane.seq, "base_version": lane.base, "tokens": lane.tokens,
                "steps": lane.steps, "phase_time_s": time.time() - self.phase_t0, "train_loss": self.loss_ema,
                "created_at": time.time(), "fragment": index}
        buffers = get_buffers(self.model, self.ctx.buffers) if index == 0 else None  # copies, taken now
        encode = functools.partial(encode_shipped, delta, codec_name=cfg.learner.codec, kind="delta",
                                   fingerprint=self.ctx.fingerprint, meta=meta, shuffle=cfg.learner.shuffle,
                                   buffers=buffers)
        encoded = encode() if self.encoder is None else None  # inline: a failure leaves the lane as it was
        seq, steps, tokens = self.lanes.take(index, self.steps_done)
        job = _Shipping(index, seq, steps, tokens, lane.base, stats)
        if encoded is not None:
            self._complete(job, *encoded, stats)
        else:
            job.future = self.encoder.submit(encode)
            self.shipping.append(job)
        if cfg.learner.mode == "sync":
            self.awaiting[index] = seq
        if index == len(self.lanes) - 1:
            self.phase_t0 = time.time()
        self._sync_state()
        return seq

    def settle(self, index: int | None = None, block: bool = True, stats: PhaseStats | None = None) -> None:
        """Complete the deltas being encoded, in the order they were taken: all of them, or up to lane `index`'s
        last (waiting for its encode), or (block=False) those already encoded; a stall waiting for the
        publisher counts in `stats` (the phase completing it), else in the phase that took the delta. An encode
        that failed ends the learner (RuntimeError), as it did on the training thread: its seq is taken."""
        while self.shipping and (index is None or any(job.index == index for job in self.shipping)):
            job = self.shipping[0]
            if not block and not job.future.done():
                return
            self.shipping.popleft()
            try:
                encoded = job.future.result()
            except Exception as err:  # dropped from the queue first: close() settles the others, then ends
                raise RuntimeError(f"learner {self.name}: encoding fragment {job.index}'s delta seq {job.seq} "
                                   f"failed: {type(err).__name__}: {err}") from err
            self._complete(job, *encoded, stats or job.stats)

    def _complete(self, job: _Shipping, data: bytes, shipped, stats: PhaseStats | None) -> None:
        """An encoded delta: its error feedback into r_p, its upload queued, its `publish` event."""
        self.lanes.feedback(job.index, shipped)
        keys = self.ctx.keys.for_fragment(job.index)
        sidecar = None
        if self.signing_key is not None:
            sidecar = (keys.signature(self.name, job.seq),
                       sign(self.signing_key, self.ctx.run_id, self.name, job.seq, data))
        stall = self.publisher.submit(keys.delta(self.name, job.seq), data, seq=job.seq, sidecar=sidecar)
        if stats is not None:
            stats.seq, stats.stall_s, stats.delta_bytes = job.seq, stats.stall_s + stall, stats.delta_bytes + len(data)
        self.events.emit("publish", learner=self.name, seq=job.seq, fragment=job.index, version=job.base,
                         bytes=len(data), tokens=job.tokens, steps=job.steps, stall_s=stall)

    # ---- install ---------------------------------------------------------------------------
    def maybe_install(self) -> list[int]:
        """Probe every lane past its overlap for its next version; install the newest. Returns the lanes moved."""
        moved, theta = [], None
        for lane in self.lanes.lanes:
            if not self.lanes.may_install(lane.index, self.steps_done):
                continue
            prefetcher = self.lane_prefetch.get(lane.index)
            if prefetcher is not None:
                fetched = prefetcher.take()
                if fetched is not None and fetched[0] > lane.base:
                    theta = theta if theta is not None else self._live()
                    self._put_lane(lane.index, *fetched, theta, prefetcher.taken_manifest)
                    moved.append(lane.index)
                continue
            keys = self.ctx.keys.for_fragment(lane.index)
            try:
                if not manifest_exists(self.quick, keys, lane.base + 1):
                    continue
                theta = theta if theta is not None else self._live()
                self._install_lane(lane.index, latest_version(self.ctx.store, keys), theta)
                moved.append(lane.index)
            except (StorageError, CodecError) as err:
                log.warning("learner %s: fragment %d install failed (%s); training on", self.name, lane.index, err)
                self.events.emit("install_failed", learner=self.name, fragment=lane.index, reason=str(err))
        if moved:
            self._sync_state()
        return moved

    def _install_lane(self, index: int, version: int, theta) -> None:
        """Fragment `index` at `version` (its compact updates, or its params when far behind) into theta."""
        lane = self.lanes.lanes[index]
        if version <= lane.base:
            return
        glob, manifest = fetch_global(fragment_context(self.ctx, index), self.ctx.store, lane.base, lane.glob,
                                      version, self.cfg.learner.max_updates_behind)
        self._put_lane(index, version, glob, theta, manifest)
        if index in self.lane_prefetch:  # installed another way (a sync wait): its prefetcher fetches from here
            self.lane_prefetch[index].rebase(version, glob)

    def _put_lane(self, index: int, version: int, glob, theta, manifest) -> None:
        """Lane `index` to `version` (its global `glob`, fetched; `manifest` its manifest) in theta; the run's
        clock from its tokens."""
        self.settle(index)  # the lane's shipped deltas' error feedback is in r_p before the carry reads it
        previous = self.lanes.lanes[index].base
        self.lanes.install(index, version, glob, theta, manifest.cursors.get(self.name, -1))
        self.run_clock(manifest.tokens_total)  # every fragment's chain merges every step's tokens once
        self.events.emit("install", learner=self.name, fragment=index, version=version, previous=previous)

    def _wait_for_decisions(self, timeout_s: float | None = None) -> None:
        """Sync mode: tau steps after a ship, block until the fragment's version deciding it, then install it."""
        timeout_s = timeout_s or self.cfg.merger.quorum_timeout_s * 4
        for index, seq in sorted(self.awaiting.items()):
            if not self.lanes.may_install(index, self.steps_done):
                continue
            self.settle()
            self.publisher.drain()
            keys, deadline = self.ctx.keys.for_fragment(index), time.time() + timeout_s
            while time.time() < deadline:
                self.heartbeat("waiting")
                manifest = read_latest(self.ctx.store, keys)
                if manifest.cursors.get(self.name, -1) >= seq:
                    self._install_lane(index, manifest.version, self._live())
                    self._sync_state()  # the next beat's figures
                    break
                time.sleep(self.cfg.merger.poll_interval_s)
            del self.awaiting[index]
        self._sync_state()

    def fragment_of(self, index: int):
        """Lane `index`'s current tensors of theta (for tests and tools)."""
        return take(self.theta(), self.lanes.lanes[index].fragment)

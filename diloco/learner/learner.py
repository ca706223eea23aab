"""A learner: inner AdamW steps on its own shard, ship-and-carry deltas per lane, install newer versions.

Contract (DESIGN §5, per chain): shipped + carried = all local progress. A delta is `r - theta`; after
shipping, `r -= dequantize(delta)` (error feedback); on a newer global `G`, `theta = G + (theta - r)`
and `r = G`. One class for every fragments.count P, over lanes (diloco.learner.lanes): P = 1 is one lane
holding every tensor whole on the root chain, shipped at the end of each phase (publish) and installed at
the probes; with P > 1 lane p ships into fragment p's chain at its staggered step during the phase and
installs no earlier than fragments.overlap_steps after. The learner never waits for anyone, except in
`sync` mode, the synchronous oracle. Multi-rank (learner.ranks > 1): this is rank 0, the only rank that
touches the bucket; the others follow its control words (diloco.learner.ranks). The buffers the run merges
ride with lane 0 (fragment 0's chain).

Its sections: the phase (diloco.learner.phase), ship (diloco.learner.ship), install (diloco.learner.install);
its parts are wired once (diloco.learner.parts); the join, status, local state and closing are here.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields

import torch

from diloco.learner.checkpoint import read_pointer
from diloco.learner.heads import IDLE_POLLS, HeadsWatcher
from diloco.learner.install import InstallSection
from diloco.learner.parts import wire
from diloco.learner.phase import PhaseSection
from diloco.learner.phase_stats import PhaseStats
from diloco.learner.prefetch import Prefetcher, StepGate
from diloco.learner.resume import resume
from diloco.learner.ship import Shipping, ShipSection
from diloco.learner.state import LearnerState
from diloco.learner.world import CLOCK, FULL, STOP, World
from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.run.fragments import fragment_context
from diloco.storage import RunKeys, StorageError
from diloco.storage.records import LearnerStatus, write_record
from diloco.training.buffers import get_buffers, set_buffers
from diloco.training.data import shard_of
from diloco.training.model import get_flat_params, set_params
from diloco.training.spec import TrainSpec
from diloco.training.tensors import Tensors

__all__ = ["HEARTBEAT_EVERY_S", "Learner", "PhaseStats"]
log = logging.getLogger("diloco.learner")
HEARTBEAT_EVERY_S = 2.0  # status.json refresh while training; the supervisor's timeout is far longer


class Learner(PhaseSection, ShipSection, InstallSection):
    """One island of compute. Drive it with join(), then run_phase() + publish() in a loop."""

    def __init__(self, ctx: RunContext, name: str, spec: TrainSpec | None = None, *,
                 events: EventLog | None = None, slowdown: float | None = None, world: World | None = None,
                 signing_key: bytes | None = None) -> None:
        parts = wire(ctx, name, spec, events=events, world=world, signing_key=signing_key)
        for part in fields(parts):  # ctx, name, cfg, model, trainer, lanes, publisher, ... (LearnerParts)
            setattr(self, part.name, getattr(parts, part.name))
        self.whole = not ctx.fragments  # one lane, the root chain's, shipped at the end of each phase
        # a CPU learner's inner steps and its prefetchers' folds take turns (their temporaries would add up)
        self.gate = StepGate() if self._device().type == "cpu" else None
        # heterogeneous hardware (a chaos plan's `slow` fault): steps take this x longer
        self.slowdown = slowdown or 1.0
        # whether the run has ended (diloco.run.signals.RoleStop; set by run_learner): checked at each probe,
        # so a phase ends within probe_every_steps of the run's end instead of training on to its H
        self.stop_check: Callable[[], bool] | None = None
        self.shard, self.num_shards = shard_of(name, ctx.learners)
        self.cursor = 0  # batches of this learner's shard consumed so far (what a resume continues from)
        self._batches: Iterator | None = None  # the spec's batches from `cursor`, opened at join
        self.lane_prefetch: dict[int, Prefetcher] = {}  # learner.prefetch: each lane's, fetching off-thread
        self.heads: HeadsWatcher | None = None  # ... and with fragments, the one poll that wakes them
        # inner.schedule_clock "run" before the first step (tokens per step unknown): (tokens_total, own step)
        self._clock_pending: tuple[int, int] | None = None
        self.loss_ema = float("nan")
        self.phase_t0 = time.time()
        self._last_beat = 0.0
        self._saved_step = -1  # the inner step of the last local save (a phase's end saves once)
        self.steps_done = 0  # since join, plus the cohort's offset (stagger): the lanes' schedule counts it
        self.awaiting: dict[int, int] = {}  # sync mode with fragments: lane -> seq waiting for its decision
        # learner.encode_in_background: deltas taken, being encoded on the encoder's thread (FIFO); each
        # completes (error feedback, upload queued, event) on the training thread before its lane is read
        self.shipping: deque[Shipping] = deque()

    # ---- the lanes and their chains -----------------------------------------------------------
    @property
    def state(self) -> LearnerState:
        """Where the learner stands: the whole model's lane itself, or the lanes summed up (LearnerState.over:
        the oldest base, the seqs and the unmerged summed), what its status reports."""
        return self.lanes.lanes[0] if self.whole else LearnerState.over(self.lanes.lanes)

    @property
    def prefetcher(self) -> Prefetcher | None:
        """The whole model's prefetcher (learner.prefetch), None with fragments: each lane has its own."""
        return self.lane_prefetch.get(0) if self.whole else None

    @prefetcher.setter
    def prefetcher(self, value: Prefetcher | None) -> None:
        if value is None:
            self.lane_prefetch.pop(0, None)
        else:
            self.lane_prefetch[0] = value

    def chain(self, index: int) -> RunContext:
        """Lane `index`'s chain: the run's context itself for the whole model, else fragment `index`'s."""
        return fragment_context(self.ctx, index)

    def chain_keys(self, index: int) -> RunKeys:
        return self.ctx.keys.for_fragment(None if self.whole else index)

    def tag(self, index: int) -> dict:
        """The `fragment` field of lane `index`'s events and delta header (none for the whole model)."""
        return {} if self.whole else {"fragment": index}

    def stagger(self) -> int:
        """fragments.cohorts: this learner's schedule offset, (k % cohorts) * H / cohorts steps (k: its place
        in the run's learner list; a name not in it is cohort 0). The whole model: 0."""
        cohorts, h = self.cfg.fragments.cohorts, self.cfg.inner.steps_per_phase
        if self.whole:
            return 0
        k = self.ctx.learners.index(self.name) if self.name in self.ctx.learners else 0
        return (k % cohorts) * h // cohorts

    def _live(self) -> Tensors:
        """The model's own parameters (detached views: a lane reads or writes its own, copying nothing)."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _set_theta(self, theta: Tensors) -> None:
        set_params(self.model, theta)

    def theta(self) -> Tensors:
        return get_flat_params(self.model)

    # ---- join / rejoin -------------------------------------------------------------------
    def join(self) -> int:
        """Resume (diloco.learner.resume: this host's local state when it is current, else every chain's
        newest committed version with the bucket checkpoint's optimizer state and data cursor); returns the
        base version (the oldest of the fragments')."""
        self.settle()  # a rejoin: what was shipped before still goes out
        resumed = resume(self.ctx, self.name, local=self.local, events=self.events, set_theta=self._set_theta,
                         import_optimizer=self._import_optimizer, requeue=self._requeue,
                         use_checkpoint=self.cfg.learner.checkpoint,
                         set_buffers=lambda values: set_buffers(self.model, values, self.ctx.buffers))
        for index, state in enumerate(resumed.lanes):
            self.lanes.adopt(index, state, self._device())
        self.cursor = resumed.cursor
        self.trainer.step = max(self.trainer.step, resumed.step)  # fragments: the last status's may be ahead
        if not self.whole:
            self._place(resumed.schedule)
        # the run's clock as the resume read it (taken at the first step); none in an outage: the own step
        # count until an install
        if resumed.tokens_total is not None:
            self.run_clock(resumed.tokens_total)
        self._open_batches()
        if self.world is not None:
            self.world.pending |= FULL  # the other ranks take parameters, optimizer state, step and cursor
        self.events.emit("join", learner=self.name, version=self.state.base, seq=self.state.seq,
                         cursor=resumed.cursor, step=resumed.step, **resumed.extra,
                         baseline_rss_bytes=self.baseline_rss_bytes, **self.memory(),
                         **({} if self.whole else self.lanes.meta()))
        self.heartbeat("joined", force=True, wait=True)  # the supervisor reads it to see the join
        if self.cfg.learner.checkpoint:  # the cadence counts from the join; the bucket's moments stay named
            self.checkpointer.joined(read_pointer(self.ctx.store, self.ctx.keys, self.name))
        self._start_prefetch()
        log.info("learner %s joined at version %d, next seq %d, data cursor %d, step %d %s", self.name,
                 self.state.base, self.state.seq, resumed.cursor, resumed.step,
                 resumed.extra or ("" if self.whole else self.lanes.meta()))
        return self.state.base

    def _place(self, schedule: dict | None) -> None:
        """The lanes' schedule after a join: from the cohort's offset at H, or where a local state left it."""
        h = self.cfg.inner.steps_per_phase
        self.lanes.steps_per_phase, self.lanes.shift, self.steps_done = h, 0, self.stagger()
        self.awaiting = {}
        if schedule:
            self.steps_done, self.lanes.shift = int(schedule["steps_done"]), int(schedule["shift"])
            self.lanes.steps_per_phase = int(schedule["steps_per_phase"])
            for lane, at in zip(self.lanes.lanes, schedule.get("shipped_at", []), strict=False):
                lane.shipped_at = int(at)
        self.pace.last_steps = self.lanes.steps_per_phase  # DyLU retimes from here

    def _import_optimizer(self, tensors: Mapping[str, torch.Tensor], meta: dict) -> int:
        self.trainer.import_state(tensors, meta, copy=False)  # read for this (a local state, a checkpoint)
        return self.trainer.step

    def _start_prefetch(self) -> None:
        """learner.prefetch (not in sync mode): a Prefetcher per lane, from the lane's version just joined."""
        self._close_prefetch()
        cfg = self.cfg.learner
        if not cfg.prefetch or cfg.mode == "sync":
            return
        # a fragmented learner's lanes are woken by one poll of the merger shards' heads (HeadsWatcher) and
        # poll by themselves only every prefetch_idle_poll_s (default IDLE_POLLS x prefetch_poll_s)
        idle_s = cfg.prefetch_idle_poll_s or cfg.prefetch_poll_s * (1 if self.whole else IDLE_POLLS)
        for lane in self.lanes.lanes:
            who = self.name if self.whole else f"{self.name}-f{lane.index}"
            self.lane_prefetch[lane.index] = Prefetcher(
                self.chain(lane.index), self.ctx.store, who, lane.base, lane.glob, poll_s=cfg.prefetch_poll_s,
                max_updates_behind=cfg.max_updates_behind, spill=self.lanes.spill, gate=self.gate,
                idle_poll_s=idle_s)
        if not self.whole:
            self.heads = HeadsWatcher(self.ctx.store, self.ctx.keys, self.lane_prefetch,
                                      self.cfg.merger.shards, cfg.prefetch_poll_s, self.name)

    def _close_prefetch(self) -> None:
        if self.heads is not None:
            self.heads.close()
            self.heads = None
        for prefetcher in self.lane_prefetch.values():
            prefetcher.close()
        self.lane_prefetch = {}

    # ---- local state ---------------------------------------------------------------------
    def save_local(self) -> None:
        """Write the whole state to this host now (diloco.learner.local_state): theta, the optimizer state and
        the buffers streamed from the live tensors; each lane's r and G named by their spill files (on an
        accelerator, r is written too). Nothing is copied whole in memory."""
        if self.local is None:
            return
        meta = {"learner": self.name, "step": self.trainer.step, "cursor": self.cursor,
                "optimizer": self.trainer.state_meta(), **self._lanes_meta()}
        self._saved_step = self.trainer.step
        self.local.save({"theta": self._live(), "ref": [lane.ref for lane in self.lanes.lanes],
                         "glob": [lane.glob for lane in self.lanes.lanes],
                         "opt": dict(self.trainer.state_tensors()),
                         "buffers": get_buffers(self.model, self.ctx.buffers)}, meta)

    def _lanes_meta(self) -> dict:
        """The lanes in a save's meta: the whole model's state at the top level (LearnerState.meta, as before
        fragments), or every lane's with the schedule. A lane whose delta is still being encoded is saved as
        before that delta was taken: its r_p - theta_p still holds it (no error feedback yet)."""
        if self.whole:
            return self.state.meta()
        lanes = []
        for lane in self.lanes.lanes:
            meta = {**lane.meta(), "fragment": lane.index}
            pending = [job for job in self.shipping if job.index == lane.index]
            if pending:
                meta.update(next_seq=pending[0].seq,
                            steps_since_publish=lane.steps + sum(j.steps for j in pending),
                            tokens_since_publish=lane.tokens + sum(j.tokens for j in pending))
            lanes.append(meta)
        return {"lanes": lanes, "schedule": {"steps_done": self.steps_done, "shift": self.lanes.shift,
                                             "steps_per_phase": self.lanes.steps_per_phase,
                                             "shipped_at": [lane.shipped_at for lane in self.lanes.lanes]}}

    # ---- status, pace, clock -------------------------------------------------------------
    def heartbeat(self, state: str = "training", force: bool = False, wait: bool = False,
                  **phase: float) -> None:
        """Refresh learners/<me>/status.json (at most every HEARTBEAT_EVERY_S unless forced);
        `phase` sets LearnerStatus fields (the per-phase figures after a phase). Written by the courier
        thread unless `wait`: the status is taken now, so a stuck training thread still goes silent."""
        now = time.time()
        if not force and now - self._last_beat < HEARTBEAT_EVERY_S:
            return
        self._last_beat = now
        where = self.state
        status = LearnerStatus.model_validate({
            "learner": self.name, "state": state, "t": now, "pid": os.getpid(), "seq": where.seq - 1,
            "base_version": where.base, "step": self.trainer.step, "cursor": self.cursor,
            "loss": self.loss_ema, "bytes_published": self.publisher.bytes_published,
            **self.pace.status(), "unmerged": where.reported_unmerged(),
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
        """The next phase's length: H, or inner.dylu's H_w from this learner's speed and its peers' (Pace);
        with fragments the lanes retimed to it (their place in the cycle kept)."""
        steps = self.pace.next_steps(self.events)
        if not self.whole and steps != self.lanes.steps_per_phase:
            self.lanes.retime(steps, self.steps_done)
        return steps

    def flush_events(self) -> None:
        """Write the buffered events from the courier thread (EventLog keeps them if the write fails)."""
        self.courier.post("events", self.events.flush)

    def run_clock(self, tokens_total: int, at_step: int | None = None) -> None:
        """inner.schedule_clock "run": put the schedule at the run's step, `tokens_total` (merged into the
        version installed at own step `at_step`, default now) / (learners x this learner's tokens per step),
        plus the own steps since; it advances one per own step from here. Only merged tokens count: no guess
        at the steps in flight (adding this learner's unshipped steps for every learner's was 0.3% worse on
        the hetero row, docs/bench/quality.md). Before the learner's first step (tokens per step unknown: a
        join) the clock is kept for then. With fragments any chain's tokens do: each merges every step's
        tokens once."""
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

    # ---- the end -------------------------------------------------------------------------
    def drain(self) -> None:
        """Every delta taken encoded and uploaded (tests, tools: the publisher's drain, after the encoder)."""
        self.settle()
        self.publisher.drain()

    def close(self, timeout_s: float = 60.0) -> None:
        self._close_prefetch()
        try:
            self.settle()  # every delta taken is uploaded, as when it was encoded on the training thread
        finally:
            if self.encoder is not None:
                self.encoder.shutdown(wait=False, cancel_futures=True)
            if self.world is not None:
                self.world.control(STOP)
            self.publisher.close(timeout_s)
            if self.local is not None:
                self.local.close()
            else:
                self.lanes.spill.close()
            self.courier.close()
            self.events.emit("stop", learner=self.name, seq=self.state.seq, version=self.state.base)
            self.events.flush()

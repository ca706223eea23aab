"""A learner's inner phase (a section of diloco.learner.learner.Learner): H inner steps on its shard, the
lanes due shipped on their schedule (fragments), probes and installs of newer versions, the periodic local
saves.

Contract: a phase of `num_steps` steps (or fewer: the run's end, seen at a probe, ends it there); every step's
progress is unshipped in every lane until its lane ships it; a newer version is installed at the next probe
(every learner.probe_every_steps steps; every step with a prefetcher, which costs no request); in `sync` mode
a fragmented learner waits, tau steps after a ship, for the version deciding it (the whole model waits after
its publish: diloco.learner.loop). A non-finite training loss abandons the phase: nothing of this learner's
unshipped progress reaches a merge, it rejoins every chain's newest version with seq, step and data cursor
going on.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext

import torch

from diloco.learner.phase_stats import PhaseStats
from diloco.learner.ranks import lead_step
from diloco.learner.resume import read_params
from diloco.learner.world import PARAMS, RESET, slice_batch
from diloco.run.buffers import install_buffers
from diloco.run.heap import status_bytes
from diloco.storage import read_latest
from diloco.training.spec import SpecError

log = logging.getLogger("diloco.learner")


class PhaseSection:
    """Learner.run_phase and what it needs: the batches, the run's end, the abandon of a failed phase."""

    def _open_batches(self) -> None:
        try:
            self._batches = iter(self.spec.batches(self.shard, self.num_shards, self.cursor))
        except Exception as err:  # noqa: BLE001 - user code
            raise SpecError(f"batches({self.shard}, {self.num_shards}, {self.cursor}) failed: "
                            f"{type(err).__name__}: {err}") from err

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

    def run_phase(self, num_steps: int | None = None) -> PhaseStats:
        """H inner steps (or `num_steps`: a shorter first phase, a per-learner H), shipping the lanes due
        (fragments) and probing for newer versions every few steps. A non-finite training loss abandons the
        phase: its progress never reaches a merge (see abandon_phase)."""
        num_steps = num_steps or self.cfg.inner.steps_per_phase
        stats, t0, losses, done = PhaseStats(), time.time(), [], 0
        for i in range(num_steps):
            ts = time.time()
            if self.world is not None:
                lead_step(self)
            batch = self._next_batch()
            try:
                with stats.timed("compute_s"), self.gate.step() if self.gate is not None else nullcontext():
                    losses.append(self.trainer.train_step(batch))
            except FloatingPointError as err:
                return self.abandon_phase(stats, t0, str(err))
            if self._clock_pending is not None:
                self.run_clock(*self._clock_pending)
            self.lanes.stepped(self.trainer.last_tokens)
            self.steps_done += 1
            stats.tokens += self.trainer.last_tokens
            if self.slowdown > 1.0:
                with stats.timed("compute_s"):  # slower hardware: its steps take longer
                    time.sleep((time.time() - ts) * (self.slowdown - 1.0))
            done = i + 1
            if not self.whole:
                self.ship_due(stats)
            self.heartbeat()
            if self.run_ended_at(done):
                break  # the phase ends here; its steps ship with the lanes' next deltas
            self._probe(stats, done)
            self._save_every(stats, done, num_steps)
        stats.steps = done
        stats.loss = sum(losses) / len(losses) if losses else float("nan")
        stats.phase_time_s = time.time() - t0
        self.loss_ema = stats.loss
        self.events.emit("phase", learner=self.name, version=self.state.base, steps=stats.steps,
                         tokens=stats.tokens, t_start=t0, duration_s=stats.phase_time_s, loss=stats.loss,
                         **stats.times(), **self.memory())
        return stats

    def memory(self) -> dict[str, int]:
        """This process's resident memory's high-water mark so far (VmHWM), and on CUDA the device's peak
        allocation: what `diloco bench size` reports per parameter (absent where not measurable)."""
        out = {}
        if (peak := status_bytes("VmHWM")) is not None:
            out["peak_rss_bytes"] = peak
        if self.device.startswith("cuda"):
            out["device_peak_bytes"] = int(torch.cuda.max_memory_allocated())
        return out

    def _probe(self, stats: PhaseStats, done: int) -> None:
        """After step `done` of the phase: the sync waits due (fragments), or a probe for newer versions —
        every learner.probe_every_steps steps, or every step with prefetchers (taking what they fetched is
        free: measured, docs/bench/wan.md)."""
        cfg = self.cfg.learner
        if cfg.mode == "sync":
            if not self.whole:
                self.wait_for_decisions()
            return
        if self.lane_prefetch or done % cfg.probe_every_steps == 0:
            with stats.timed("install_s"):
                installed = self.maybe_install()
            if self.whole:
                stats.installs.extend([] if installed is None else [installed])
            else:
                stats.installs.extend(installed)

    def _save_every(self, stats: PhaseStats, done: int, num_steps: int) -> None:
        """learner.local_state_every_steps: a save every N steps, skipped while the last save's time is more
        than a tenth of the time since (LocalState.due: at 124M parameters a save writes 1.5 GB, and a GPU
        learner's 10 steps take far less). The whole model's phase end is saved by publish()."""
        every = self.cfg.learner.local_state_every_steps
        if every and done % every == 0 and (done < num_steps or not self.whole) and self.local.due():
            with stats.timed("save_s"):
                self.save_local()

    def run_ended_at(self, step_in_phase: int) -> bool:
        """At a probe (every learner.probe_every_steps steps of a phase): whether the run has ended (target,
        stop, removal: stop_check), so the phase ends there instead of training on to its H."""
        return (step_in_phase % self.cfg.learner.probe_every_steps == 0 and self.stop_check is not None
                and self.stop_check())

    def abandon_phase(self, stats: PhaseStats, t0: float, reason: str) -> PhaseStats:
        """A non-finite loss: nothing of this learner's unshipped progress may reach a merge. Drop it (the
        deltas already taken still go out), reset the optimizer's state (its moments may be poisoned), and
        rejoin every chain at its newest version (full params); seq, step and data cursor go on. Recorded as a
        `phase_failed` event with the reason."""
        log.warning("learner %s: %s; the phase is abandoned and the learner rejoins the newest version",
                    self.name, reason)
        self.settle()
        self.events.emit("phase_failed", learner=self.name, version=self.state.base, reason=reason[:300],
                         unshipped_steps=self.state.steps_since_publish, t_start=t0)
        theta, tokens_total = self._live(), 0
        for lane in self.lanes.lanes:
            manifest = read_latest(self.ctx.store, self.chain_keys(lane.index))
            glob = read_params(self.ctx, lane.index, manifest)
            self.lanes.join(lane.index, manifest.version, glob, lane.seq, theta,
                            manifest.cursors.get(self.name, -1))
            if lane.index == 0:  # a NaN may have reached the running statistics too
                install_buffers(self.ctx, self.model, manifest)
            tokens_total = max(tokens_total, manifest.tokens_total)
        self.trainer.reset_optimizer()
        if self.world is not None:
            self.world.pending |= PARAMS | RESET
        self.run_clock(tokens_total)
        for index, prefetcher in self.lane_prefetch.items():
            prefetcher.rebase(self.lanes.lanes[index].base, self.lanes.lanes[index].glob)
        stats.phase_time_s, stats.tokens = time.time() - t0, 0
        return stats

"""The long-running loops of a learner and of the evaluator, plus the signals they share (stop, removed).

Contract: a loop ends by itself when the run is stopped (control/stop), when the target version
is committed, or after its count; storage trouble is logged and ridden out, never fatal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from diloco.learner.learner import Learner, PhaseStats
from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.run.objects import read_tensors
from diloco.storage import NotFound, StorageError, latest_version, read_manifest
from diloco.storage.errors import Backoff
from diloco.storage.records import (
    EvalRecord,
    RecordError,
    RemovedMark,
    StopRequest,
    read_record,
    write_record,
)
from diloco.training.data import Corpus, eval_batches
from diloco.training.inner import evaluate
from diloco.training.model import build_model, set_params

log = logging.getLogger("diloco.loops")


class StopSignal:
    """`control/stop` in the bucket, or the target version committed; checked at most every `every_s`."""

    def __init__(self, ctx: RunContext, target_version: int | None = None, every_s: float = 1.0) -> None:
        self.ctx, self.target, self.every_s = ctx, target_version, every_s
        self.store = ctx.store.with_retries(1)  # checked often: an outage must not stall the caller
        self._last, self._stopped = 0.0, False

    def __call__(self) -> bool:
        if self._stopped:
            return True
        now = time.time()
        if now - self._last < self.every_s:
            return False
        self._last = now
        try:
            if self.store.exists(self.ctx.keys.stop()):
                self._stopped = True
            elif self.target is not None:
                latest = latest_version(self.store, self.ctx.keys)
                self._stopped = latest is not None and latest >= self.target
        except StorageError:
            return False
        return self._stopped


def request_stop(ctx: RunContext, reason: str) -> None:
    """Ask every role of the run to end (control/stop)."""
    write_record(ctx.store, ctx.keys.stop(), StopRequest(reason=reason, t=time.time()))


def request_remove(ctx: RunContext, learner: str, reason: str = "operator") -> None:
    """Mark a learner removed (control/removed-<learner>): it ends after the current phase and is never
    restarted or re-submitted."""
    write_record(ctx.store, ctx.keys.removed(learner), RemovedMark(reason=reason, t=time.time()))


class RemovedSignal:
    """True once control/removed-<learner> exists; checked at most every `every_s`."""

    def __init__(self, ctx: RunContext, learner: str, every_s: float = 1.0) -> None:
        self.key, self.ctx, self.every_s = ctx.keys.removed(learner), ctx, every_s
        self._last, self._removed = 0.0, False

    def __call__(self) -> bool:
        if not self._removed and time.time() - self._last >= self.every_s:
            self._last = time.time()
            try:
                self._removed = self.ctx.store.exists(self.key)
            except StorageError:
                return False
        return self._removed


def write_status(learner: Learner, stats: PhaseStats, state: str) -> None:
    """The heartbeat after a phase, with the phase's own figures."""
    learner.heartbeat(state, force=True, loss=stats.loss, tokens_per_phase=stats.tokens, stall_s=stats.stall_s,
                      steps_per_s=stats.steps / stats.phase_time_s if stats.phase_time_s else 0.0)


def learner_step(learner: Learner, should_stop: Callable[[], bool]) -> PhaseStats:
    """One phase + publish (+ wait in sync mode) + heartbeat: the unit a Prefect task wraps."""
    stats = learner.run_phase()
    seq = learner.publish(stats)
    if seq is not None and learner.cfg.learner.mode == "sync":
        learner.wait_for_decision(seq, timeout_s=learner.cfg.merger.quorum_timeout_s * 4, should_stop=should_stop)
    write_status(learner, stats, "training")
    learner.flush_events()
    return stats


JOIN_ATTEMPTS = 8  # with the back-off below: ~30 s of waiting (plus the store's own retries), then give up
JOIN_BACKOFF_S = (0.5, 8.0)  # first wait, cap; doubled per attempt


def join_with_retry(learner: Learner, join: Callable[[Learner], int], should_stop: Callable[[], bool],
                    attempts: int = JOIN_ATTEMPTS) -> bool:
    """Join, retrying StorageError with bounded exponential back-off (a learner restarted during an
    outage waits it out); the join event is flushed at once so a SIGKILL right after keeps it.
    Returns False if the run stopped while waiting; re-raises the last StorageError when out of attempts."""
    backoff = Backoff(*JOIN_BACKOFF_S)
    for attempt in range(1, attempts + 1):
        try:
            join(learner)
            break
        except StorageError as err:
            if attempt == attempts:
                raise
            wait_s = backoff.next_s()
            log.warning("learner %s: join failed (attempt %d/%d), retrying in %.1f s: %s",
                        learner.name, attempt, attempts, wait_s, err)
            time.sleep(wait_s)
            if should_stop():
                return False
    learner.events.flush()
    return True


def run_learner(learner: Learner, *, phases: int | None = None, should_stop: Callable[[], bool],
                on_phase: Callable[[PhaseStats], None] | None = None,
                step: Callable[[Learner, Callable[[], bool]], PhaseStats] = learner_step,
                join: Callable[[Learner], int] = Learner.join) -> int:
    """Join (retried through storage trouble), then phases until stopped; returns the number of phases
    run. `step` and `join` are the units a Prefect flow wraps as tasks."""
    if not join_with_retry(learner, join, should_stop):
        learner.close()
        return 0
    done = 0
    try:
        while not should_stop() and (phases is None or done < phases):
            if learner.publisher.fenced.is_set():
                raise RuntimeError(f"learner {learner.name}: another process publishes under this name")
            stats = step(learner, should_stop)
            done += 1
            if on_phase:
                on_phase(stats)
    finally:
        learner.close()
    return done


class Evaluator:
    """Held-out loss of committed versions, written to evals/<version>.json."""

    def __init__(self, ctx: RunContext, corpus: Corpus, events: EventLog | None = None) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        torch.set_num_threads(1)
        self.model = build_model(self.cfg.model, seed=self.cfg.data.seed)
        self.batches = eval_batches(corpus.heldout, self.cfg.eval.num_batches, self.cfg.eval.batch_size,
                                    self.cfg.model.ctx_len, seed=self.cfg.data.seed)
        self.events = events or EventLog(None, None, "evaluator")
        self.done: set[int] = set()

    def evaluate_version(self, version: int) -> dict:
        manifest = read_manifest(self.ctx.store, self.ctx.keys, version)
        _, params = read_tensors(self.ctx.store, manifest.params_key, fingerprint=self.ctx.fingerprint,
                                   checksum=manifest.params_checksum)
        set_params(self.model, params)
        loss = evaluate(self.model, self.batches)
        record = EvalRecord(version=version, loss=loss, bits_per_byte=loss / 0.6931471805599453,
                            tokens_total=manifest.tokens_total, t=time.time(), committed_at=manifest.created_at)
        write_record(self.ctx.store, self.ctx.keys.eval(version), record)
        self.done.add(version)
        return record.model_dump()

    def due(self, latest: int, final: bool = False) -> int | None:
        """The version to evaluate next: 0 first, then the newest on the cadence, the last at the end."""
        if 0 not in self.done:
            return 0
        if latest in self.done:
            return None
        if final or latest % self.cfg.eval.every_versions == 0:
            return latest
        return None

    def next_due(self, final: bool = False) -> int | None:
        """The version to evaluate now, if any (one listing; storage trouble means none yet)."""
        try:
            latest = latest_version(self.ctx.store, self.ctx.keys)
        except StorageError as err:
            log.warning("evaluation skipped: %s", err)
            return None
        return None if latest is None else self.due(latest, final)


def read_evals(ctx: RunContext) -> list[dict]:
    """Every readable eval record of the run (EvalRecord fields), by version; unreadable ones are skipped."""
    out = []
    for key in ctx.store.list(ctx.keys.evals_prefix()):
        try:
            out.append(read_record(ctx.store, key, EvalRecord))
        except (StorageError, RecordError):
            continue
    return [r.model_dump() for r in sorted(out, key=lambda r: r.version)]


def run_evaluator(evaluator: Evaluator, *, should_stop: Callable[[], bool], poll_s: float = 0.5,
                  evaluate: Callable[[Evaluator, int], dict | None] | None = None) -> int:
    """Evaluate committed versions until stopped, then the final one; returns how many.
    `evaluate` (default Evaluator.evaluate_version) is the unit a Prefect flow wraps as a task:
    it runs only when a version is due, never per poll."""
    evaluate = evaluate or (lambda ev, version: ev.evaluate_version(version))
    count = 0

    def once(final: bool) -> bool:
        nonlocal count
        version = evaluator.next_due(final)
        if version is None:
            return False
        try:
            evaluate(evaluator, version)
            count += 1
        except (StorageError, NotFound) as err:
            log.warning("evaluation of version %d skipped: %s", version, err)
            return False
        return True

    while not should_stop():
        if not once(False):
            time.sleep(poll_s)
    while once(True):  # version 0 and the final version, if still missing
        pass
    evaluator.events.flush()
    return count

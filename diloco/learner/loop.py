"""The long-running loop of a learner: join (retried through storage trouble), then phases until stopped.

Contract: the loop ends by itself when its stop signal says so (control/stop, the target version, removal,
a lost supervisor) or after its count, and then writes its final state in status.json (finished, stopped,
removed); a run that has already ended is not joined (its learners' statuses stay as they were); storage
trouble is logged and ridden out, never fatal; a learner fenced by another process publishing under its
name stops with an error (and no final state).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from diloco.learner.learner import Learner, PhaseStats
from diloco.storage import StorageError
from diloco.storage.errors import Backoff

log = logging.getLogger("diloco.learner")


def write_status(learner: Learner, stats: PhaseStats, state: str) -> None:
    """The heartbeat after a phase, with the phase's own figures (and a traffic event)."""
    # its speed, reported below; inner.dylu: the peers'
    if learner.pace.observe(stats.steps, stats.compute_s):
        learner.courier.post("pace", learner.pace.refresh)
    learner.heartbeat(state, force=True, loss=stats.loss, tokens_per_phase=stats.tokens,
                      stall_s=stats.stall_s,
                      steps_per_s=stats.steps / stats.phase_time_s if stats.phase_time_s else 0.0)
    emit_traffic(learner)


def emit_traffic(learner: Learner) -> None:
    """A `traffic` event: the bytes this process has put and got so far, by object kind (when its store
    counts them: diloco.storage.traffic.CountingStore, as launch.make_learner sets it up)."""
    traffic = getattr(learner.ctx.store, "traffic", None)
    if traffic is None:
        return
    with traffic.lock:
        sent, received = dict(traffic.sent), dict(traffic.received)
    learner.events.emit("traffic", learner=learner.name, sent=sent, received=received, counters=traffic.id)


def learner_step(learner: Learner, should_stop: Callable[[], bool]) -> PhaseStats:
    """One phase + publish (+ wait in sync mode) + heartbeat: the unit a Prefect task wraps."""
    stats = learner.run_phase(learner.next_phase_steps())
    seq = learner.publish(stats)
    if seq is not None and learner.cfg.learner.mode == "sync":
        learner.wait_for_decision(seq, timeout_s=learner.cfg.merger.quorum_timeout_s * 4,
                                  should_stop=should_stop)
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
                join: Callable[[Learner], int] = lambda learner: learner.join(),
                why: Callable[[], str | None] = lambda: None) -> int:
    """Join (retried through storage trouble), then phases until stopped; returns the number of phases
    run. `step` and `join` are the units a Prefect flow wraps as tasks; `why` names the final state once
    should_stop fired (finished, stopped, removed: diloco.run.signals.RoleStop), "stopped" if it cannot."""
    if should_stop():  # the run ended before this process got going: nothing to join, nothing to overwrite
        log.warning("learner %s: the run has ended (%s); not joining", learner.name, why() or "stopped")
        learner.close()
        return 0
    if not join_with_retry(learner, join, should_stop):
        learner.close()
        return 0
    done = 0
    learner.stop_check = should_stop  # a phase also ends at its next probe once the run has ended
    try:
        while not should_stop() and (phases is None or done < phases):
            if learner.publisher.fenced.is_set():
                why = learner.publisher.stop_reason or "another process publishes under this name"
                raise RuntimeError(f"learner {learner.name}: {why}")
            stats = step(learner, should_stop)
            done += 1
            if on_phase:
                on_phase(stats)
    finally:
        learner.close()
        emit_traffic(learner)
        learner.events.flush()
    learner.heartbeat(why() or "stopped", force=True, wait=True)  # its final state, after the last upload
    return done

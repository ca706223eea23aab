"""A learner's compute speed, and DyLU (`inner.dylu`): each learner's H from its measured speed, so slower
hardware publishes at the fast learners' wall rate instead of carrying twice the wall time into every delta.

Contract: the speed is inner steps per second of compute (train_step, a slowdown included, storage waits not),
averaged over phases (SPEED_EMA the newest phase's weight); every status reports it. H_w = floor(v_w / v_max *
H), v_max the fastest of this learner and its live peers (their status.json's `compute_steps_per_s`, beaten
within run.heartbeat_timeout_s, not in a final state; an unreadable or implausible status is skipped). H_w = H
until both are known, while v_w >= DEAD_BAND * v_max (learners of one speed, measured with noise, keep one H),
and with DyLU off; never below `min_steps` or H / MAX_SHRINK. Peers are read off the training thread
(`refresh`, on the learner's courier, at most every REFRESH_S once a peer's speed is known; after every phase
until then), so a phase never waits for them; a peer unreadable at a read is left out of it.
"""

from __future__ import annotations

import logging
import time

from diloco.storage import NotFound, StorageError
from diloco.storage.records import FINAL_STATES, LearnerStatus, RecordError, beat_age, read_record

log = logging.getLogger("diloco.learner")
DEAD_BAND = 0.9  # a learner at >= 90% of the fastest keeps H: one speed with noise is one H
SPEED_EMA = 0.3  # one phase's speed varies by 10-20% on a shared machine: averaged, one speed is one H
# H_w >= H / 8: a learner far slower than the rest (or a peer's implausible speed) publishes at
MAX_SHRINK = 8
# most 8x as often as at H
REFRESH_S = 30.0  # the peers' speeds read again at most this often: M learners read M-1 statuses each


def phase_steps(steps_per_phase: int, own_steps_per_s: float | None, fastest_steps_per_s: float | None,
                min_steps: int = 1) -> int:
    """H_w = floor(v_w / v_max * H), at least `min_steps` and H / MAX_SHRINK; H when a speed is unknown or
    within the dead band."""
    if not own_steps_per_s or not fastest_steps_per_s or own_steps_per_s >= DEAD_BAND * fastest_steps_per_s:
        return steps_per_phase
    floor = max(min_steps, steps_per_phase // MAX_SHRINK)  # below the dead band the share is < H already
    return max(floor, int(own_steps_per_s / fastest_steps_per_s * steps_per_phase))


class Pace:
    """One learner's speed and its peers' fastest: `observe` after a phase (the training thread), `refresh`
    reads the peers (the courier's thread), `next_steps` is the next phase's H_w (H with DyLU off)."""

    def __init__(self, store, keys, name: str, peers: list[str], steps_per_phase: int, *,
                 enabled: bool = True, min_steps: int = 1, timeout_s: float = 60.0) -> None:
        self.store, self.keys, self.name, self.enabled = store, keys, name, enabled
        self.peers = [p for p in peers if p != name]
        self.steps_per_phase, self.min_steps, self.timeout_s = steps_per_phase, min_steps, timeout_s
        self.own_steps_per_s: float | None = None  # averaged over phases
        self.peers_steps_per_s: float | None = None  # the fastest live peer's; None: none known
        self.refreshed_at = 0.0  # when the peers were last read (unix seconds)
        self.last_steps = steps_per_phase  # the H of the last phase paced

    def observe(self, steps: int, compute_s: float) -> bool:
        """A phase of `steps` inner steps that computed for `compute_s` seconds; whether the peers are due a
        read."""
        if steps > 0 and compute_s > 0:
            speed, last = steps / compute_s, self.own_steps_per_s
            self.own_steps_per_s = speed if last is None else last + SPEED_EMA * (speed - last)
        return self.enabled and time.time() - self.refreshed_at >= REFRESH_S

    def status(self) -> dict:
        """The status fields of this learner's speed (none before its first phase)."""
        return {"compute_steps_per_s": self.own_steps_per_s} if self.own_steps_per_s else {}

    def refresh(self, now: float | None = None) -> None:
        """The fastest live peer's compute speed, from their status.json (a peer unreadable now is
        skipped)."""
        now = time.time() if now is None else now
        self.refreshed_at, fastest = now, None
        for peer in self.peers:
            try:
                status = read_record(self.store, self.keys.status(peer), LearnerStatus)
            except (NotFound, RecordError, StorageError):
                continue
            speed = status.compute_steps_per_s
            age = beat_age(status.t, now)  # a beat from the future is no live peer (records.beat_age)
            if speed and status.state not in FINAL_STATES and age is not None and age <= self.timeout_s:
                fastest = speed if fastest is None else max(fastest, speed)
        self.peers_steps_per_s = fastest
        if fastest is None:  # no peer has reported a speed yet: read again after the next phase
            self.refreshed_at = 0.0

    def fastest(self) -> float | None:
        known = [s for s in (self.own_steps_per_s, self.peers_steps_per_s) if s]
        return max(known) if known else None

    def steps(self) -> int:
        """H_w from the speeds known now (H with DyLU off)."""
        if not self.enabled:
            return self.steps_per_phase
        return phase_steps(self.steps_per_phase, self.own_steps_per_s, self.fastest(), self.min_steps)

    def next_steps(self, events) -> int:
        """The next phase's H_w; a `pace` event (and a log line) when it changes."""
        steps = self.steps()
        if steps != self.last_steps:
            events.emit("pace", learner=self.name, steps_per_phase=steps, steps_per_s=self.own_steps_per_s,
                        fastest_steps_per_s=self.fastest())
            log.info("learner %s: H %d (DyLU: %.2f steps/s, the fastest %.2f)", self.name, steps,
                     self.own_steps_per_s or 0.0, self.fastest() or 0.0)
        self.last_steps = steps
        return steps

"""Goodput of a run under faults, from its events and manifests (DESIGN §8), and of data-parallel
training under the same faults by its own rules. Formulas: docs/CHAOS.md.

Contract: pure functions of (events, manifests); nothing is read from live processes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from diloco.inspect.lifecycle import (
    Event,
    Interval,
    Life,
    clip,
    lifecycles,
    standby_intervals,
    subtract,
    total,
    union,
)
from diloco.storage import Manifest

DEFAULT_CHECKPOINT_COST_S = 5.0  # a data-parallel checkpoint of model + optimizer to the bucket, stated


@dataclass
class Goodput:
    decoupled_goodput: float
    dp_goodput: float
    availability: float
    ready_fraction: float  # learner-time joined and computing (not starting, not paused) / provisioned
    provisioned_s: float  # learners x wall time
    useful_s: float  # learner-seconds of compute whose deltas reached a committed version
    up_s: float  # learner-seconds alive and not paused
    wall_s: float
    num_failures: int
    dp_checkpoint_interval_s: float  # Young-Daly
    dp_useful_s: float  # wall seconds of data-parallel progress kept
    step_time_s: dict[str, float]
    standby_s: float = 0.0  # spare-seconds of warm standbys waiting: memory provisioned, no compute, not "up"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def step_times(events: list[Event], learners: list[str]) -> dict[str, float]:
    """Measured seconds per inner step of each learner: its phases' duration / steps (phase events)."""
    sums: dict[str, list[float]] = {name: [0.0, 0.0] for name in learners}
    for e in events:
        if e.get("kind") == "phase" and e.get("learner") in sums and e.get("steps"):
            sums[e["learner"]][0] += float(e.get("duration_s", 0.0))
            sums[e["learner"]][1] += float(e["steps"])
    all_s, all_n = sum(s for s, _ in sums.values()), sum(n for _, n in sums.values())
    fallback = all_s / all_n if all_n else 0.0
    return {name: (s / n if n else fallback) for name, (s, n) in sums.items()}


def merged_steps(manifests: list[Manifest], learners: list[str], t_end: float) -> dict[str, int]:
    """Per learner, the inner steps of its deltas merged in versions committed by t_end."""
    steps = {name: 0 for name in learners}
    for m in manifests:
        if m.created_at <= t_end:
            for d in m.merged():
                if d.learner in steps:
                    steps[d.learner] += d.steps
    return steps


def useful_compute_s(manifests: list[Manifest], times: dict[str, float], t_end: float) -> float:
    """Sum over deltas merged in versions committed by t_end: steps x the learner's step time."""
    return sum(n * times[name] for name, n in merged_steps(manifests, list(times), t_end).items())


def per_learner(events: list[Event], manifests: list[Manifest],
                learners: list[str]) -> dict[str, dict[str, float]]:
    """Where each learner's provisioned time went: alive, ready (joined, not paused), inside phases,
    and useful (its merged steps x step time; partial phases saved before a kill and merged after it
    count, so useful can exceed phase time). provisioned - alive is planned down time and restarts;
    alive - ready is process start and join; ready - phase is time between phases (publishing, status,
    events) and phases cut short by a kill; phase - useful is computed work not merged in the window."""
    lives, (t0, t1) = lifecycles(events, learners)
    times = step_times(events, learners)
    merged = merged_steps(manifests, learners, t1)
    out = {}
    for name in learners:
        phases = [e for e in events if e.get("kind") == "phase" and e.get("learner") == name and e["t"] <= t1]
        out[name] = {
            "provisioned_s": t1 - t0, "alive_s": total(lives[name].alive),
            "ready_s": total(subtract(lives[name].ready, lives[name].paused)),
            "phase_s": sum(float(e.get("duration_s", 0.0)) for e in phases),
            "phase_steps": sum(int(e.get("steps", 0)) for e in phases), "merged_steps": merged[name],
            "step_time_s": times[name], "useful_s": merged[name] * times[name],
        }
    return out


def young_daly_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """The optimal checkpoint interval sqrt(2 C MTBF) (first order)."""
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s) if math.isfinite(mtbf_s) else math.inf


def dp_progress_s(productive: list[Interval], failures: list[float], tau_s: float, cost_s: float) -> float:
    """Wall seconds of lock-step progress kept: work tau, checkpoint C, repeat; a failure loses
    the work since the last completed checkpoint; the work since it at the end is kept."""
    marks = sorted([(a, 0, b) for a, b in productive] + [(t, 1, t) for t in failures])
    useful = since = ck_left = 0.0
    for start, kind, end in marks:
        if kind == 1:
            since = ck_left = 0.0
            continue
        left = end - start
        while left > 1e-12:
            if ck_left > 0:
                d = min(left, ck_left)
                ck_left -= d
                if ck_left <= 1e-12:
                    useful, since, ck_left = useful + since, 0.0, 0.0
            else:
                d = min(left, tau_s - since)
                since += d
                if since >= tau_s - 1e-12:
                    ck_left = cost_s if cost_s > 0 else 0.0
                    if cost_s <= 0:
                        useful, since = useful + since, 0.0
            left -= d
    return useful + since


def slowdown_efficiency(events: list[Event], learners: list[str]) -> float:
    """Lock-step runs at the slowest learner: mean(slowdown) / max(slowdown)."""
    factors = {name: 1.0 for name in learners}
    for e in events:
        if e.get("kind") == "chaos_plan":
            for f in e.get("faults", []):
                if f.get("kind") == "slow_learner" and f.get("learner") in factors:
                    factors[f["learner"]] = float(f["factor"])
    return sum(factors.values()) / len(factors) / max(factors.values()) if factors else 1.0


def dp_goodput(lives: dict[str, Life], window: Interval, cost_s: float, efficiency: float = 1.0,
               ) -> tuple[float, float, float]:
    """(goodput, Young-Daly interval, kept progress): everyone stalls while any learner is not ready
    (dead, restarting, starting) or paused; a failure of any learner loses the work since the last
    checkpoint."""
    t0, t1 = window
    wall = t1 - t0
    stalls = union([iv for life in lives.values()
                    for iv in subtract([(t0, t1)], life.ready) + life.paused])
    productive = subtract([(t0, t1)], stalls)
    failures = sorted(t for life in lives.values() for t in life.failures)
    mtbf = wall / len(failures) if failures else math.inf
    tau = young_daly_s(cost_s, mtbf)
    kept = dp_progress_s(productive, failures, tau, cost_s)
    return (kept / wall * efficiency if wall > 0 else 0.0), tau, kept


def compute_goodput(events: list[Event], manifests: list[Manifest], learners: list[str],
                    checkpoint_cost_s: float = DEFAULT_CHECKPOINT_COST_S) -> Goodput:
    """Decoupled goodput, availability and data-parallel goodput of one recorded run."""
    lives, (t0, t1) = lifecycles(events, learners)
    wall = t1 - t0
    provisioned = wall * len(learners)
    up = sum(total(subtract(life.alive, life.paused)) for life in lives.values())
    ready = sum(total(subtract(life.ready, life.paused)) for life in lives.values())
    times = step_times(events, learners)
    useful = min(useful_compute_s(manifests, times, t1), provisioned)
    dp, tau, kept = dp_goodput(lives, (t0, t1), checkpoint_cost_s, slowdown_efficiency(events, learners))
    return Goodput(
        decoupled_goodput=useful / provisioned if provisioned else 0.0, dp_goodput=dp,
        availability=up / provisioned if provisioned else 0.0,
        ready_fraction=ready / provisioned if provisioned else 0.0, provisioned_s=provisioned,
        useful_s=useful, up_s=up, wall_s=wall,
        num_failures=sum(len(life.failures) for life in lives.values()),
        dp_checkpoint_interval_s=tau, dp_useful_s=kept, step_time_s=times,
        standby_s=total(standby_intervals(events, learners)),
    )


__all__ = ["Goodput", "clip", "compute_goodput", "dp_goodput", "dp_progress_s", "per_learner", "step_times",
           "young_daly_s"]

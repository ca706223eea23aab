"""Learner lifecycles read back from recorded events: when each learner was alive, paused, ready, killed.

Contract: a pure function of the event list (supervisor + learner events); intervals are clipped to
the run's window [start, end]; a join lost with a SIGKILLed process is estimated from the others.
A warm standby is not the learner: its events carry role "standby"; the learner is alive from the
`start` the supervisor records when it activates the spare, never while the spare waits.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

Interval = tuple[float, float]
Event = dict[str, Any]


@dataclass
class Life:
    """One learner over the run: alive (process running), paused (SIGSTOP), ready (joined, computing)."""

    name: str
    alive: list[Interval] = field(default_factory=list)
    paused: list[Interval] = field(default_factory=list)
    ready: list[Interval] = field(default_factory=list)
    failures: list[float] = field(default_factory=list)  # SIGKILLs and crashes


def run_window(events: list[Event]) -> Interval:
    """[first process start, supervisor end] — or the span of all events when those are missing."""
    starts = [e["t"] for e in events if e.get("source") == "supervisor" and e.get("kind") == "start"]
    ends = [e["t"] for e in events if e.get("source") == "supervisor" and e.get("kind") == "end"]
    t0 = min(starts) if starts else (events[0]["t"] if events else 0.0)
    t1 = min(ends) if ends else (events[-1]["t"] if events else t0)
    return t0, max(t0, t1)


def total(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def clip(intervals: list[Interval], t0: float, t1: float) -> list[Interval]:
    return [(max(a, t0), min(b, t1)) for a, b in intervals if min(b, t1) > max(a, t0)]


def union(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(base: list[Interval], holes: list[Interval]) -> list[Interval]:
    out = []
    for a, b in base:
        cur = a
        for h0, h1 in union(holes):
            if h1 <= cur or h0 >= b:
                continue
            if h0 > cur:
                out.append((cur, h0))
            cur = max(cur, h1)
        if cur < b:
            out.append((cur, b))
    return out


def _learner_events(events: list[Event], name: str) -> list[Event]:
    out = []
    for e in events:
        if e.get("learner") != name:
            continue
        by_supervisor = e.get("source") == "supervisor" and e.get("role", "learner") == "learner"
        if by_supervisor or (e.get("source") == name and e.get("kind") == "join"):
            out.append(e)
    return out


def _walk(life: Life, evs: list[Event], t1: float) -> list[tuple[float, float | None]]:
    """Fill alive/paused/failures; return (start, join or None) per incarnation."""
    up_since: float | None = None
    pause_since: float | None = None
    incarnations: list[tuple[float, float | None]] = []
    for e in evs:
        kind, t = e["kind"], e["t"]
        if kind == "start":
            up_since = t
            incarnations.append((t, None))
        elif kind == "join" and incarnations and incarnations[-1][1] is None:
            incarnations[-1] = (incarnations[-1][0], t)
        elif kind in ("kill", "exit") and up_since is not None:
            life.alive.append((up_since, t))
            if kind == "kill" or e.get("code", 0) != 0:
                life.failures.append(t)
            up_since = None
        elif kind == "pause":
            pause_since = t
        elif kind == "resume" and pause_since is not None:
            life.paused.append((pause_since, t))
            pause_since = None
    if up_since is not None:
        life.alive.append((up_since, t1))
    if pause_since is not None:
        life.paused.append((pause_since, t1))
    return incarnations


def standby_intervals(events: list[Event], learners: list[str]) -> list[Interval]:
    """When warm spares existed (spawned → activated, died or stopped): idle provisioned memory, not
    compute."""
    open_at: dict[tuple[str, int], float] = {}
    out: list[Interval] = []
    t0, t1 = run_window(events)
    for e in events:
        if e.get("source") != "supervisor" or e.get("role") != "standby" or e.get("learner") not in learners:
            continue
        key = (e["learner"], int(e.get("pid", 0)))
        if e["kind"] == "standby":
            open_at[key] = e["t"]
        elif e["kind"] == "standby_end" and key in open_at:
            out.append((open_at.pop(key), e["t"]))
    out += [(a, t1) for a in open_at.values()]
    return clip(out, t0, t1)


def lifecycles(events: list[Event], learners: list[str]) -> tuple[dict[str, Life], Interval]:
    """Per learner its Life, clipped to the run window; and the window itself."""
    t0, t1 = run_window(events)
    lives, starts = {}, {}
    for name in learners:
        life = Life(name)
        starts[name] = _walk(life, _learner_events(events, name), t1)
        lives[name] = life
    delays = [j - s for inc in starts.values() for s, j in inc if j is not None]
    typical = statistics.median(delays) if delays else 0.0
    for name, life in lives.items():
        ready = []
        for (s, j), (_a, b) in zip(starts[name], life.alive, strict=False):
            ready.append((j if j is not None else s + typical, b))
        life.ready = clip([(a, b) for a, b in ready if b > a], t0, t1)
        life.alive = clip(life.alive, t0, t1)
        life.paused = clip(life.paused, t0, t1)
        life.failures = [t for t in life.failures if t0 <= t <= t1]
    return lives, (t0, t1)

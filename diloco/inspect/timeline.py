"""The chaos timeline of a run, from its recorded events: what each learner was doing when.

Contract: `timeline(events)` returns (who, state, t0, t1) rows sorted by t0; learner states are
starting (its process was started, it has not joined yet: imports, the join's download), training (inside
a phase: the `phase` events' spans, and gaps under IDLE_MIN_S between phases), idle (joined but not in a
phase: waiting on storage, a sync decision, the stop), down (killed or exited until started again) and
paused; publishing runs in the background while the next phase trains, so it is no state of its own.
Merges (who = merger id) and injected faults (who = "chaos", state = "fault:<kind>") are points, t0 == t1.
"""

from __future__ import annotations

from diloco.inspect.lifecycle import Event, run_window

Row = tuple[str, str, float, float]
IDLE_MIN_S = 0.5  # a shorter gap between two phases (the ship step) is drawn as training
_SUPERVISOR_KINDS = {"start": "starting", "kill": "down", "exit": "down", "pause": "paused"}


def _learner_names(events: list[Event]) -> list[str]:
    names = {e["learner"] for e in events if e.get("source") == "supervisor" and e.get("role") == "learner"
             and isinstance(e.get("learner"), str)}
    return sorted(names)


def _transitions(events: list[Event], name: str) -> list[tuple[float, str]]:
    """(t, state) changes; a phase's start counts as a join (a join event lost with its process)."""
    out = []
    for e in events:
        kind, source = e.get("kind"), e.get("source")
        if source == name and kind == "join":
            out.append((e["t"], "idle"))
        elif source == name and kind == "phase" and (span := _phase_span(e)) is not None:
            out.append((span[0], "joined"))
        elif source == "supervisor" and e.get("learner") == name:
            if kind in _SUPERVISOR_KINDS:
                out.append((e["t"], _SUPERVISOR_KINDS[kind]))
            elif kind == "resume":
                out.append((e["t"], "resume"))
    return out


def _base_rows(events: list[Event], name: str, t_end: float) -> list[Row]:
    """starting / idle / down / paused intervals, before the phases are drawn in."""
    rows: list[Row] = []
    state: str | None = None
    since, before_pause = 0.0, "starting"
    for t, new in sorted(_transitions(events, name)):
        if new == "joined":
            new = "idle" if state in (None, "starting") else state
        if new == "resume":
            new = before_pause
        elif new == "paused":
            before_pause = state or "starting"
        if new == state:
            continue
        if state is not None:
            rows.append((name, state, since, t))
        state, since = new, t
    if state is not None and t_end > since:
        rows.append((name, state, since, t_end))
    return rows


def _phase_span(e: Event) -> tuple[float, float] | None:
    """(start, end) of a `phase` event: its t_start (or t - duration_s) to its t."""
    if isinstance(e.get("t_start"), (int, float)):
        return float(e["t_start"]), float(e["t"])
    if isinstance(e.get("duration_s"), (int, float)):
        return float(e["t"]) - float(e["duration_s"]), float(e["t"])
    return None


def _phases(events: list[Event], name: str) -> list[tuple[float, float]]:
    """The learner's phases as spans, gaps under IDLE_MIN_S closed."""
    spans = sorted(span for e in events if e.get("source") == name and e.get("kind") == "phase"
                   and (span := _phase_span(e)) is not None)
    merged: list[tuple[float, float]] = []
    for a, b in spans:
        if merged and a - merged[-1][1] < IDLE_MIN_S:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def learner_rows(events: list[Event], name: str, t_end: float) -> list[Row]:
    """One learner's state intervals: starting from its process start until it joins, then training inside
    its phases and idle between them, down after a kill or exit, paused while stopped."""
    rows: list[Row] = []
    phases = _phases(events, name)
    for who, state, a, b in _base_rows(events, name, t_end):
        if state != "idle":
            rows.append((who, state, a, b))
            continue
        cur = a
        for p0, p1 in phases:
            if p1 <= cur or p0 >= b:
                continue
            if p0 > cur:
                rows.append((who, "idle", cur, p0))
            rows.append((who, "training", max(cur, p0), min(b, p1)))
            cur = min(b, p1)
        if cur < b:
            rows.append((who, "idle", cur, b))
    return rows


def point_rows(events: list[Event]) -> list[Row]:
    rows: list[Row] = []
    for e in events:
        if e.get("kind") == "merge" and isinstance(e.get("source"), str):
            rows.append((e["source"], "merge", e["t"], e["t"]))
        elif e.get("source") == "chaos" and e.get("kind") == "fault":
            rows.append(("chaos", f"fault:{e.get('fault')}", e["t"], e["t"]))
    return rows


def timeline(events: list[Event]) -> list[Row]:
    """Every learner's states as intervals, plus merges and faults as points, sorted by start time."""
    _, t_end = run_window(events)
    rows: list[Row] = []
    for name in _learner_names(events):
        rows.extend(learner_rows(events, name, t_end))
    rows.extend(point_rows(events))
    return sorted(rows, key=lambda r: (r[2], r[0]))

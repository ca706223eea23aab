"""The chaos timeline of a run, from its recorded events: what each learner was doing when.

Contract: `timeline(events)` returns (who, state, t0, t1) rows sorted by t0; learner states are
training / publishing / down / paused; merges (who = merger id) and injected faults (who = "chaos",
state = "fault:<kind>") are points with t0 == t1.
"""

from __future__ import annotations

from diloco.inspect.lifecycle import Event, run_window

Row = tuple[str, str, float, float]
_LEARNER_KINDS = {"join": "training", "publish": "publishing", "published": "training"}
_SUPERVISOR_KINDS = {"start": "down", "kill": "down", "exit": "down", "pause": "paused"}


def _learner_names(events: list[Event]) -> list[str]:
    names = {e["learner"] for e in events if e.get("source") == "supervisor" and e.get("role") == "learner"
             and isinstance(e.get("learner"), str)}
    return sorted(names)


def _transitions(events: list[Event], name: str) -> list[tuple[float, str]]:
    out = []
    for e in events:
        kind, source = e.get("kind"), e.get("source")
        if source == name and kind in _LEARNER_KINDS:
            out.append((e["t"], _LEARNER_KINDS[kind]))
        elif source == "supervisor" and e.get("learner") == name:
            if kind in _SUPERVISOR_KINDS:
                out.append((e["t"], _SUPERVISOR_KINDS[kind]))
            elif kind == "resume":
                out.append((e["t"], "resume"))
    return out


def learner_rows(events: list[Event], name: str, t_end: float) -> list[Row]:
    """One learner's state intervals: down from its process start until it joins, and so on."""
    rows: list[Row] = []
    state: str | None = None
    since, before_pause = 0.0, "down"
    for t, new in _transitions(events, name):
        if new == "resume":
            new = before_pause
        elif new == "paused":
            before_pause = state or "down"
        if new == state:
            continue
        if state is not None:
            rows.append((name, state, since, t))
        state, since = new, t
    if state is not None and t_end > since:
        rows.append((name, state, since, t_end))
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

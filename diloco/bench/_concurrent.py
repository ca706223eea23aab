"""A deterministic clock for `bench quality`: every learner computes at the same time, in ticks of
`learner.probe_every_steps` steps, as real learners do — not one cohort after another.

Contract: each tick every learner whose speed allows it runs one chunk (a probe at its end, as in a real
phase), learners whose phase is complete publish, then the merger merges while a quorum of learners has a
delta pending (a merge is visible at the following tick's probes: a tick of delay, like a prefetch). Two
cohorts half a phase apart (odd learners start with half a phase); a learner of speed s < 1 computes a chunk
on a fraction s of the ticks; `h_per_learner` gives each learner its own H (DyLU). Exactly `target_tokens`
are trained: chunks stop at the budget, leftovers are published and merged at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diloco.learner.learner import Learner
from diloco.merger.merger import Merger


@dataclass
class Clocked:
    """One learner on the clock: its speed (chunks per tick), its H and where it is in its phase."""

    learner: Learner
    speed: float
    h: int
    phase_left: int
    credit: float = 0.0


def clocked(learners: list[Learner], speeds: list[float], hs: list[int], tick: int,
            stagger: bool = True) -> list[Clocked]:
    """`stagger`: odd learners start with half a phase (two cohorts); else everyone in step."""
    out = []
    for i, (learner, speed, h) in enumerate(zip(learners, speeds, hs, strict=True)):
        if h % tick:
            raise ValueError(f"H of learner {i} ({h}) must be a multiple of the tick ({tick} steps)")
        half = stagger and i % 2 == 1 and (h // 2) % tick == 0
        first = h // 2 if half else h  # the second cohort: half a phase first
        out.append(Clocked(learner, speed, h, first))
    return out


def drive_concurrent(learners: list[Clocked], merger: Merger, tick: int, tokens_per_step: int,
                     target_tokens: int, quorum: int, on_tokens: Callable[[int], None]) -> tuple[int,
                                                                                                 list[int]]:
    """Run ticks until `target_tokens` are trained; returns (tokens, deltas merged per merge)."""
    tokens, merged = 0, []
    chunk_tokens = tick * tokens_per_step
    while tokens + chunk_tokens <= target_tokens:
        published = 0
        for c in learners:
            c.credit += c.speed
            if c.credit < 1.0 - 1e-9 or tokens + chunk_tokens > target_tokens:
                continue
            c.credit -= 1.0
            c.learner.run_phase(tick)  # one chunk; its last step probes (and installs what is there)
            tokens += chunk_tokens
            c.phase_left -= tick
            if c.phase_left <= 0:
                published += c.learner.publish() is not None
                c.learner.publisher.drain()
                c.phase_left = c.h
        merged += _merge_while_quorum(merger, quorum)
        on_tokens(tokens)
    for c in learners:  # what is left of a phase when the budget ran out ships too
        if c.learner.publish() is not None:
            c.learner.publisher.drain()
    merged += _merge_while_quorum(merger, 1)
    on_tokens(tokens)
    return tokens, merged


def _merge_while_quorum(merger: Merger, quorum: int) -> list[int]:
    out = []
    while merger.pending().num_learners >= quorum:
        manifest = merger.merge_once()
        if manifest is None:
            raise RuntimeError(f"merge on top of version {merger.version} committed nothing")
        out.append(len(manifest.merged()))
    return out

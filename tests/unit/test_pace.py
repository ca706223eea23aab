"""DyLU's rule (inner.dylu, diloco.learner.pace) and the lanes' retime: H_w = floor(v_w / v_max * H) outside
the dead band, never below its floor (min_steps, H / 8); a retimed schedule keeps its place in the cycle, and
in every later cycle each fragment ships once. Run: .venv/bin/pytest tests/unit/test_pace.py -q
"""

from __future__ import annotations

import pytest

from diloco.learner.lanes import Lanes
from diloco.learner.pace import DEAD_BAND, phase_steps
from diloco.training.fragments import due_offset


@pytest.mark.parametrize(("own", "fastest", "expected"), [
    (1.0, 2.0, 25),  # half the speed: half the steps, the same wall time
    (1.0, 3.0, 16),  # floor(50 / 3)
    (0.5, 10.0, 6),  # floor(2.5) = 2, raised to H / 8 (a far slower learner publishes at most 8x as often)
    (1.0, 1e300, 6),  # a peer's implausible speed: the same bound
    (DEAD_BAND * 2.0, 2.0, 50),  # within the dead band: one H for one speed measured with noise
    (1.7, 2.0, 42),  # just outside it
    (2.0, 2.0, 50),  # the fastest itself
    (None, 2.0, 50),  # its own speed not measured yet
    (1.0, None, 50),  # nobody's known
])
def test_each_learner_runs_its_share_of_h(own, fastest, expected):
    assert phase_steps(50, own, fastest, min_steps=3) == expected


def test_the_floor_is_the_larger_of_min_steps_and_h_over_8():
    assert phase_steps(16, 1.0, 100.0, min_steps=3) == 3 and phase_steps(16, 1.0, 100.0, min_steps=1) == 2


def _lanes(count: int, h: int) -> Lanes:
    return Lanes([{"tensors": [f"t{i}"]} for i in range(count)], h, tau=2)


def _ships(lanes: Lanes, steps: range) -> list[tuple[int, int]]:
    out = []
    for step in steps:
        lanes.stepped(1)
        for index in lanes.due(step):
            out.append((step, index))
            lanes.take(index, step)
    return out


@pytest.mark.parametrize(("count", "old", "new", "at"), [(4, 50, 25, 25), (4, 50, 25, 37), (2, 12, 30, 7),
                                                         (3, 24, 9, 100), (1, 10, 4, 3)])
def test_a_retimed_schedule_keeps_its_place_and_ships_each_fragment_once_a_cycle(count, old, new, at):
    lanes = _lanes(count, old)
    _ships(lanes, range(1, at + 1))
    place = at % old / old
    lanes.retime(new, at)
    assert (at + lanes.shift) % new == int(place * new)  # as far into the new cycle as into the old one
    later = _ships(lanes, range(at + 1, at + 1 + 3 * new))
    assert sorted(index for _, index in later) == sorted(list(range(count)) * 3)
    for step, index in later:  # fragment p at offset p*H/P of the new cycle
        assert (step + lanes.shift) % new == due_offset(index, count, new) % new


def test_a_cohort_retimed_at_its_offset_matches_one_that_started_on_the_new_h():
    """A learner of cohort 1 of 2 (offset H/2) retimed to H_w at its join ships as one that began at H_w/2."""
    retimed, fresh = _lanes(4, 50), _lanes(4, 25)
    retimed.retime(25, 25)
    assert _ships(retimed, range(26, 126)) == [(s + 13, i) for s, i in _ships(fresh, range(13, 113))]

"""Goodput accounting and the chaos timeline on synthetic event lists with closed-form answers.

Two learners over 100 s: `a` is killed at 50 s, restarted at 55 s and computing again at 60 s;
`b` is paused 70-75 s. Formulas: docs/CHAOS.md. Run: `.venv/bin/pytest tests/unit/test_chaos_goodput.py`.
"""

from __future__ import annotations

import math

import pytest

from diloco.chaos.goodput import compute_goodput, dp_progress_s, per_learner, young_daly_s
from diloco.inspect.timeline import timeline
from diloco.storage import DeltaDecision, Manifest


def ev(t: float, source: str, kind: str, **fields: object) -> dict:
    return {"t": t, "source": source, "kind": kind, **fields}


def sup(t: float, kind: str, learner: str, **fields: object) -> dict:
    return ev(t, "supervisor", kind, role="learner", learner=learner, **fields)


EVENTS = sorted([
    sup(0.0, "start", "a"), sup(0.0, "start", "b"),
    ev(1.0, "a", "join", learner="a"), ev(1.0, "b", "join", learner="b"),
    ev(11.0, "a", "phase", learner="a", steps=10, duration_s=10.0),
    ev(21.0, "b", "phase", learner="b", steps=10, duration_s=20.0),
    ev(20.0, "a", "publish", learner="a", seq=0), ev(20.5, "a", "published", seq=0),
    sup(50.0, "kill", "a", signal=9), sup(50.2, "exit", "a", code=-9),
    sup(55.0, "restart", "a", planned=True), sup(55.0, "start", "a"), ev(60.0, "a", "join", learner="a"),
    sup(70.0, "pause", "b"), sup(75.0, "resume", "b"),
    ev(40.0, "merger", "merge", version=1),
    ev(45.0, "chaos", "fault", fault="kill_learner", learner="a"),
    ev(100.0, "supervisor", "end", reason="time limit"),
], key=lambda e: e["t"])


def manifest(version: int, created_at: float, merged: list[tuple[str, int, int]]) -> Manifest:
    decisions = [DeltaDecision(learner=name, seq=seq, status="merged", steps=steps, tokens=steps * 10)
                 for name, seq, steps in merged]
    return Manifest(run_id="r", version=version, parent=version - 1, created_at=created_at,
                    params_key=f"r/global/{version}.params", params_checksum="x", decisions=decisions)


CHAIN = [
    Manifest(run_id="r", version=0, created_at=0.0, params_key="r/global/0.params", params_checksum="x"),
    manifest(1, 30.0, [("a", 0, 10), ("b", 0, 10)]),
    manifest(2, 90.0, [("a", 1, 20), ("chaos-0", 0, 1)]),
    manifest(3, 120.0, [("b", 1, 10)]),  # after the run ended: not counted
]


def test_closed_form_goodput() -> None:
    g = compute_goodput(EVENTS, CHAIN, ["a", "b"], checkpoint_cost_s=2.0)
    assert g.wall_s == 100.0 and g.provisioned_s == 200.0
    assert g.step_time_s == {"a": 1.0, "b": 2.0}
    # useful: v1 = 10 x 1 s + 10 x 2 s, v2 = 20 x 1 s (chaos-0 is not a learner of the run) -> 50 s
    assert g.useful_s == pytest.approx(50.0)
    assert g.decoupled_goodput == pytest.approx(0.25)
    # up: a alive 0-50 and 55-100 (95 s), b alive 100 s minus 5 s paused -> 190 of 200
    assert g.availability == pytest.approx(0.95)
    # ready (joined): a 1-50 and 60-100 (89 s), b 1-100 minus the pause (94 s) -> 183 of 200
    assert g.ready_fraction == pytest.approx(0.915)
    # data-parallel: MTBF 100 s, C = 2 s -> tau = 20 s; productive [1,50] [60,70] [75,100]:
    # work 1-21, ckpt 21-23, work 23-43, ckpt 43-45, work 45-50 lost at the kill; 60-70 + 75-85,
    # ckpt 85-87, 87-100 kept at the end -> 20 + 20 + 20 + 13 = 73 s of 100
    assert g.num_failures == 1
    assert g.dp_checkpoint_interval_s == pytest.approx(20.0)
    assert g.dp_useful_s == pytest.approx(73.0)
    assert g.dp_goodput == pytest.approx(0.73)


def test_dp_slowdown_efficiency() -> None:
    plan = ev(0.0, "chaos", "chaos_plan", faults=[{"kind": "slow_learner", "learner": "b", "factor": 3.0}])
    g = compute_goodput(sorted([*EVENTS, plan], key=lambda e: e["t"]), CHAIN, ["a", "b"],
                        checkpoint_cost_s=2.0)
    assert g.dp_goodput == pytest.approx(0.73 * (1.0 + 3.0) / 2 / 3.0)


def test_dp_progress_rules() -> None:
    assert young_daly_s(2.0, 100.0) == pytest.approx(20.0)
    assert young_daly_s(2.0, math.inf) == math.inf
    assert dp_progress_s([(0.0, 100.0)], [], math.inf, 5.0) == pytest.approx(100.0)
    # tau 10, C 5: work 0-10, ckpt 10-15, work 15-25, ckpt 25-30, work 30-32 -> failure at 32
    assert dp_progress_s([(0.0, 32.0)], [32.0], 10.0, 5.0) == pytest.approx(20.0)
    # a failure during a checkpoint loses the work it was saving
    assert dp_progress_s([(0.0, 12.0)], [12.0], 10.0, 5.0) == pytest.approx(0.0)


def test_timeline_states_and_points() -> None:
    rows = timeline(EVENTS)
    a = [(s, t0, t1) for who, s, t0, t1 in rows if who == "a"]
    # start-up is "starting", not "down"; training is what the phase events span, the rest "idle" (issue #18)
    assert a == [("starting", 0.0, 1.0), ("training", 1.0, 11.0), ("idle", 11.0, 50.0), ("down", 50.0, 55.0),
                 ("starting", 55.0, 60.0), ("idle", 60.0, 100.0)]
    b = [(s, t0, t1) for who, s, t0, t1 in rows if who == "b"]
    assert b == [("starting", 0.0, 1.0), ("training", 1.0, 21.0), ("idle", 21.0, 70.0),
                 ("paused", 70.0, 75.0), ("idle", 75.0, 100.0)]
    assert ("merger", "merge", 40.0, 40.0) in rows
    assert ("chaos", "fault:kill_learner", 45.0, 45.0) in rows
    assert [r[2] for r in rows] == sorted(r[2] for r in rows)


def test_per_learner_breakdown_adds_up_to_the_goodput() -> None:
    rows = per_learner(EVENTS, CHAIN, ["a", "b"])
    assert rows["a"] == pytest.approx({"provisioned_s": 100.0, "alive_s": 95.0, "ready_s": 89.0,
                                       "phase_s": 10.0,
                                       "phase_steps": 10, "merged_steps": 30, "step_time_s": 1.0,
                                       "useful_s": 30.0})
    assert rows["b"]["ready_s"] == pytest.approx(94.0) and rows["b"]["useful_s"] == pytest.approx(20.0)
    g = compute_goodput(EVENTS, CHAIN, ["a", "b"])
    assert sum(r["useful_s"] for r in rows.values()) == pytest.approx(g.useful_s)
    # b's pause is alive, not up
    assert sum(r["alive_s"] for r in rows.values()) - 5.0 == pytest.approx(g.up_s)

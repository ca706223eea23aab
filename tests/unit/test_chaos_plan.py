"""Fault plans: every shipped plan loads; bad YAML, unknown keys and bad values raise PlanError
naming the field; random faults are reproducible from the seed and resolved to the run's learners.
Run: `.venv/bin/pytest tests/unit/test_chaos_plan.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.chaos.plan import KillLearner, PlanError, expand, load_plan, parse_plan

PLANS = Path(__file__).resolve().parents[2] / "diloco" / "chaos" / "plans"
LEARNERS = ["local-0", "local-1", "local-2", "local-3"]


@pytest.mark.parametrize("path", sorted(PLANS.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_plans_load(path: Path) -> None:
    plan = load_plan(path)
    assert expand(plan, LEARNERS, 400.0) or plan.faults


def test_standard_plan_is_the_documented_one() -> None:
    plan = load_plan(PLANS / "standard.yaml")
    stages = sorted(f.stage for f in plan.faults if f.kind == "kill_merger")
    assert stages == ["before_manifest", "writing"]
    outages = [f for f in plan.faults if f.kind == "storage_outage"]
    assert [o.duration_s for o in outages] == [20]
    (kills,) = plan.random
    assert kills.kind == "kill_learner" and kills.mean_interval_s == 60 and kills.restart_after_s == 5
    assert plan.min_duration_s >= 300


@pytest.mark.parametrize(("text", "field"), [
    ("faults: [{kind: kill_learner, learner: 0, at_s: 1, restart_after: 5}]", "restart_after"),
    ("faults: [{kind: kill_learner, learner: 0, at_s: -1}]", "at_s"),
    ("faults: [{kind: kill_learner, learner: 0}]", "exactly one of at_s or at_version"),
    ("faults: [{kind: kill_learner, learner: 0, at_s: 1, at_version: 2}]", "exactly one of"),
    ("faults: [{kind: kill_learner, learner: Bad_Name, at_s: 1}]", "learner"),
    ("faults: [{kind: pause_learner, learner: 0, at_s: 1}]", "duration_s"),
    ("faults: [{kind: kill_merger, stage: committing, at_s: 1}]", "stage"),
    ("faults: [{kind: slow_learner, learner: 1, factor: 0.5}]", "factor"),
    ("faults: [{kind: storage_degraded, error_rate: 1.5}]", "error_rate"),
    ("faults: [{kind: bad_delta, variant: spicy, at_version: 1}]", "variant"),
    ("faults: [{kind: meteor, at_s: 1}]", "kind"),
    ("random: [{kind: kill_learner}]", "mean_interval_s"),
    ("seed: many", "seed"),
    ("chaos: yes", "chaos"),
])
def test_bad_fields_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(PlanError, match=field):
        load_plan(path)


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("faults: [unclosed")
    with pytest.raises(PlanError, match="not valid YAML"):
        load_plan(path)
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path / "absent.yaml")
    with pytest.raises(PlanError, match="mapping"):
        parse_plan([1, 2])
    assert isinstance(PlanError("x"), ValueError)


def test_learner_references_resolve_against_the_run() -> None:
    plan = parse_plan({"faults": [{"kind": "kill_learner", "learner": 5, "at_s": 1}]})
    with pytest.raises(PlanError, match="index 5"):
        expand(plan, LEARNERS, 100)
    plan = parse_plan({"faults": [{"kind": "kill_learner", "learner": "us-east-0", "at_s": 1}]})
    with pytest.raises(PlanError, match="us-east-0"):
        expand(plan, LEARNERS, 100)


def test_random_faults_are_seeded_exponential() -> None:
    data = {"seed": 11, "random": [{"kind": "kill_learner", "mean_interval_s": 10, "restart_after_s": 2}]}
    first = expand(parse_plan(data), LEARNERS, 10_000)
    again = expand(parse_plan(data), LEARNERS, 10_000)
    assert [(d.learner, d.at_s) for d in first] == [(d.learner, d.at_s) for d in again]
    assert all(isinstance(d.fault, KillLearner) and d.fault.restart_after_s == 2 for d in first)
    per_learner = [sorted(d.at_s for d in first if d.learner == name) for name in LEARNERS]
    gaps = [b - a for times in per_learner for a, b in zip([0.0, *times], times, strict=False)]
    assert 8.0 < sum(gaps) / len(gaps) < 12.0  # ~4000 draws: the mean is within 20% of 10 s
    assert [d.at_s for d in first] == sorted(d.at_s for d in first)

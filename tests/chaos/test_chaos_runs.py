"""Chaos runs: real learner, merger and evaluator processes on file:// storage under fault plans.

Fault families are combined into two short runs of the tiny recipe with two learners: (1) learners
killed (restarted by a fork from the zygote), paused and slowed, a storage outage then
errors/latency/bandwidth cap, and hostile deltas; (2) the merger killed at every stage of a merge, and a
second merger racing it (no learner is killed). After each run the invariants hold.
Each run ends as soon as its faults are all injected and claimed, its checks can be made and the
loss has recovered (at least 30 s), or at a cap. Run: `.venv/bin/pytest -m chaos tests/chaos`
(about 80 s on 2 cores, with test_standby.py; longer on a loaded machine, up to the caps).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from chaos_harness import (
    all_injected,
    assert_invariants,
    decisions,
    faults,
    latest_merger,
    loss_fell,
    merger_kills_claimed,
    run_plan,
)

from diloco.chaos.agent import ChaosAgent
from diloco.chaos.goodput import compute_goodput
from diloco.inspect.timeline import timeline
from diloco.supervise.core import Supervisor

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

WORKERS_PLAN = """
name: workers
seed: 3
faults:
  - {kind: slow_learner, learner: 1, factor: 1.5}
  - {kind: kill_learner, learner: 0, at_version: 2, restart_after_s: 1}
  - {kind: pause_learner, learner: 1, at_version: 3, duration_s: 5}
  - {kind: storage_outage, at_s: 20, duration_s: 4}
  - {kind: storage_degraded, at_s: 24, error_rate: 0.05, latency_s: 0.002, bandwidth_mbps: 100}
  - {kind: bad_delta, variant: corrupt, at_version: 1}
  - {kind: bad_delta, variant: truncated, at_version: 1}
  - {kind: bad_delta, variant: duplicated, at_version: 2}
  - {kind: bad_delta, variant: nan, at_version: 2}
  - {kind: bad_delta, variant: oversized, at_version: 3}
  - {kind: bad_delta, variant: stale, at_version: 5}
  - {kind: seq_backwards, at_version: 2}
"""

MERGER_PLAN = """
name: merger
faults:
  - {kind: second_merger, at_s: 0}
  - {kind: kill_merger, stage: listing, at_version: 1}
  - {kind: kill_merger, stage: writing, at_version: 1, merger_id: merger-2}
  - {kind: kill_merger, stage: before_manifest, at_version: 2}
  - {kind: kill_merger, stage: after_manifest, at_version: 2, merger_id: merger-2}
"""

EXPECTED_REASON = {"corrupt": "checksum", "truncated": "truncated", "duplicated": "header says",
                   "nan": "non-finite", "oversized": "oversized", "stale": "stale"}


MIN_RUN_S = 30.0  # past the storage windows (outage 20-24 s, then errors/latency/bandwidth); time to recover


def workers_done(sup: Supervisor, agent: ChaosAgent) -> bool:
    return (time.time() - sup.started_at >= MIN_RUN_S and all_injected(agent) and sup.latest() >= 8
            and loss_fell(sup))


def test_learner_storage_and_delta_faults(tmp_path: Path) -> None:
    run = run_plan(tmp_path, WORKERS_PLAN, "chaos-workers", until=workers_done,
                   **{"run.time_limit_s": 90.0, "run.num_learners": 2})
    assert_invariants(run)
    injected = {(e["fault"], e.get("variant")) for e in faults(run)}
    for variant in EXPECTED_REASON:
        assert ("bad_delta", variant) in injected, f"{variant} never injected: {injected}"
    assert {("kill_learner", None), ("pause_learner", None)} <= injected
    kinds = [(e["source"], e["kind"]) for e in run.events]
    assert ("supervisor", "pause") in kinds and ("supervisor", "resume") in kinds
    assert any(e["kind"] == "restart" and e.get("planned") for e in run.events)
    # every hostile delta was rejected with the reason its variant calls for, never merged
    by_key = decisions(run)
    for e in faults(run):
        if e["fault"] == "bad_delta":
            seq = int(e["key"].rsplit("/", 1)[1].split(".")[0])
            (_, status, reason), = by_key[(e["learner"], seq)]
            assert status == "rejected" and EXPECTED_REASON[e["variant"]] in reason, (e["variant"], reason)
    # the learner whose seq went backwards: 0 and 1 declared lost with 2 decided (merged, or stale after
    # the gap wait); the late seq 1 landed below the cursor and was never decided again
    assert by_key[("chaos-1", 0)][0][1] == "lost" and by_key[("chaos-1", 1)][0][1] == "lost"
    assert by_key[("chaos-1", 2)][0][1] in ("merged", "rejected")
    assert run.ctx.store.exists(run.ctx.keys.delta("chaos-1", 1))
    assert ("chaos", "fault_end") in kinds  # the outage window ended (recorded)
    report = compute_goodput(run.events, run.chain, run.ctx.learners)
    assert 0 < report.decoupled_goodput <= report.availability <= 1
    assert report.num_failures >= 1
    states = {row[1] for row in timeline(run.events)}
    assert {"training", "down", "paused", "merge"} <= states


def merger_done() -> Callable[[Supervisor, ChaosAgent], bool]:
    """Every kill claimed and its process gone, both mergers seen committing, and a few versions since."""
    winners: set[str] = set()

    def done(sup: Supervisor, agent: ChaosAgent) -> bool:
        winners.add(latest_merger(sup) or "")
        exits = sum(len(p.exits) for p in sup.jobs.values() if p.role == "merger")
        return (time.time() - sup.started_at >= MIN_RUN_S and all_injected(agent)
                and merger_kills_claimed(agent) and exits >= 4 and {"merger", "merger-2"} <= winners
                and sup.latest() >= 8 and loss_fell(sup))

    return done


def test_merger_killed_at_every_stage_and_racing(tmp_path: Path) -> None:
    run = run_plan(tmp_path, MERGER_PLAN, "chaos-merger", until=merger_done(),
                   **{"run.time_limit_s": 100.0, "run.restart_backoff_s": 0.2, "run.num_learners": 2})
    assert_invariants(run)
    kills = {(e["source"], e["stage"]) for e in run.events if e["kind"] == "chaos_self_kill"}
    assert kills == {("merger", "listing"), ("merger-2", "writing"), ("merger", "before_manifest"),
                     ("merger-2", "after_manifest")}
    merger_exits = [e for e in run.events if e["kind"] == "exit" and e.get("role") == "merger"]
    assert len(merger_exits) >= 4
    assert {m.merger_id for m in run.chain[1:]} == {"merger", "merger-2"}  # both won some versions
    # the mid-merge kill left an orphan update (no manifest) that no version refers to
    referenced = {k for m in run.chain for k in (m.params_key, m.update_key, m.outer_key)}
    orphans = [k for k in run.ctx.store.list(run.ctx.keys.global_prefix()) if k not in referenced]
    assert any(k.endswith(".update") for k in orphans)

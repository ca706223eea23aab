"""Chaos with fragments: a run of 4 fragments over 2 merger shards whose shards are killed mid-merge (shard 1
before its manifest, shard 0 while writing). The supervisor restarts each; a killed shard stalls only its own
fragments; every fragment chain is written by its own shard only and audits (replays) clean;
goodput is counted on the slowest fragment chain (what every fragment has merged).

Run: `.venv/bin/pytest -m chaos tests/chaos/test_fragment_chaos.py` (about 20 s on 2 cores).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from chaos_harness import all_injected, merger_kills_claimed, run_plan

from diloco.chaos.agent import ChaosAgent
from diloco.chaos.goodput import compute_goodput
from diloco.inspect.report import fragment_chains, slowest_chain
from diloco.run.fragments import fragment_versions
from diloco.storage import read_manifest
from diloco.supervise.core import Supervisor

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

SHARDS_PLAN = """
name: shards
faults:
  - {kind: kill_merger, stage: before_manifest, at_version: 1, merger_id: merger-s1}
  - {kind: kill_merger, stage: writing, at_version: 2, merger_id: merger}
"""


def shards_done(sup: Supervisor, agent: ChaosAgent) -> bool:
    exits = sum(len(j.exits) for j in sup.jobs.values() if j.role == "merger")
    return (time.time() - sup.started_at >= 10 and all_injected(agent) and merger_kills_claimed(agent)
            and exits >= 2 and sup.latest() >= 5)


def test_killed_merger_shards_restart_and_their_chains_audit_clean(tmp_path: Path) -> None:
    run = run_plan(tmp_path, SHARDS_PLAN, "chaos-shards", until=shards_done,
                   **{"run.time_limit_s": 90.0, "run.restart_backoff_s": 0.2, "run.num_learners": 2,
                      "fragments.count": 4, "merger.shards": 2})
    assert run.reason == "done", run.reason
    assert run.audit.ok and run.audit.replay_ok, run.audit.problems
    kills = {(e["source"], e["stage"]) for e in run.events if e["kind"] == "chaos_self_kill"}
    assert kills == {("merger-s1", "before_manifest"), ("merger", "writing")}
    exits = {e.get("learner") for e in run.events if e["kind"] == "exit" and e.get("role") == "merger"}
    assert {"merger", "merger-s1"} <= exits
    # goodput from the slowest fragment chain's merged steps (what every fragment has merged)
    report = compute_goodput(run.events, slowest_chain(fragment_chains(run.ctx)), run.ctx.learners)
    assert 0 < report.decoupled_goodput <= report.availability <= 1
    versions = fragment_versions(run.ctx)
    assert min(versions) >= 5
    for p, version in enumerate(versions):
        keys = run.ctx.keys.for_fragment(p)
        writers = {read_manifest(run.ctx.store, keys, v).merger_id for v in range(1, version + 1)}
        assert writers == {"merger" if p % 2 == 0 else "merger-s1"}, (p, writers)

"""Learners as torch.distributed worlds: two learners of two ranks each (gloo, DDP) train a tiny run with
real processes; a chaos plan kills one rank of a learner, the whole learner world ends and is restarted as
one, it rejoins at the newest version, the held-out loss falls and audit replays every merge.

Run: .venv/bin/pytest -m chaos tests/chaos/test_ranks_world.py   (about a minute on 2 cores)
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from chaos_harness import assert_invariants, faults, loss_fell, run_plan

from diloco.storage.records import LearnerStatus, read_record
from diloco.supervise.core import Supervisor

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

PLAN = """
name: ranks
faults:
  - {kind: kill_rank, learner: 1, rank: 1, at_version: 3}
"""


def test_a_killed_rank_restarts_its_whole_learner_and_it_rejoins(tmp_path: Path) -> None:
    start = time.time()

    def done(sup: Supervisor, agent) -> bool:
        job = sup.jobs["local-1"]
        return (not agent.pending and len(job.history) >= 2 and sup.joined(job) and sup.latest() >= 8
                and loss_fell(sup) and time.time() - start > 20)

    run = run_plan(tmp_path, PLAN, "ranks", until=done, **{"run.num_learners": 2, "learner.ranks": 2,
                                                           "run.time_limit_s": 200,
                                                           "run.restart_backoff_s": 0.2})
    assert_invariants(run)
    killed = faults(run)
    assert len(killed) == 1 and killed[0]["rank"] == 1
    exits = [e for e in run.events if e.get("source") == "supervisor" and e["kind"] == "exit"
             and e.get("learner") == "local-1"]
    assert exits and exits[0]["code"] != 0  # the launcher ended with its world
    joins = [e for e in run.events if e.get("kind") == "join" and e.get("source") == "local-1"]
    assert len(joins) >= 2
    # rejoined and then came up to a newer version: it may resume from its local state (base and unshipped
    # steps kept), whose base can be older than the version at the kill; it installs the newest after a phase
    after = run.events[run.events.index(joins[-1]):]
    newer = [e for e in after if e.get("source") == "local-1" and e.get("kind") == "install"]
    assert newer and newer[-1]["version"] >= 3, "the restarted learner never installed a newer version"
    status = read_record(run.ctx.store, run.ctx.keys.status("local-0"), LearnerStatus)
    assert status.ranks == 2 and len(status.rank_pids) == 2

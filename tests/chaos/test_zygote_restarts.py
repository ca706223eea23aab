"""The zygote start method: learners are forked (fast restarts, no spares); if the zygote dies, the
supervisor says so and execs from then on, and training goes on.
Run: `.venv/bin/pytest -m chaos tests/chaos/test_zygote_restarts.py` (about 30 s on 2 cores).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from chaos_harness import assert_no_children, wait_for

from diloco.configs import load_config
from diloco.run.create import create_run
from diloco.run.events import read_events
from diloco.storage import open_store
from diloco.supervise.local import local_supervisor

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def joins(ctx, name: str) -> list[dict]:
    return [e for e in read_events(ctx.store, ctx.keys)
            if e.get("kind") == "join" and e.get("source") == name]


def test_forked_restart_then_exec_after_the_zygote_dies(tmp_path: Path) -> None:
    cfg = load_config("tiny").with_overrides({"run.num_learners": 1, "run.num_versions": 1_000_000,
                                              "run.restart_backoff_s": 0.1})
    ctx = create_run(open_store(f"file://{tmp_path}/store"), "zygote", cfg)
    sup = local_supervisor(ctx, log_dir=str(tmp_path / "logs"),
                           env={"OMP_NUM_THREADS": "1", "DILOCO_LOCAL_DIR": str(tmp_path / "local")})
    name = ctx.learners[0]
    try:
        sup.start_all()
        proc, backend = sup.jobs[name], sup.backend
        wait_for(lambda: joins(ctx, name), 120, "the first join")
        assert backend.zygote is not None and proc.handle.pid != backend.zygote.proc.pid
        # a planned restart is a fork: it joins again within seconds, and no spare was ever started
        first = proc.handle.pid
        assert sup.restart_after(name, 0.0, reason="test")
        wait_for(lambda: (sup.heal(), sup.alive(proc) and proc.handle.pid != first)[1], 30,
                 "the forked restart")
        wait_for(lambda: len(joins(ctx, name)) >= 2, 30, "the second join")
        assert not backend.standbys
        # the zygote dies: the next restart is an exec, recorded, and the learner joins again
        os.killpg(backend.zygote.proc.pid, signal.SIGKILL)
        backend.zygote.proc.wait(timeout=10)
        second = proc.handle.pid
        assert sup.restart_after(name, 0.0, reason="test")
        wait_for(lambda: (sup.heal(), sup.alive(proc) and proc.handle.pid != second)[1], 30,
                 "the exec restart")
        wait_for(lambda: len(joins(ctx, name)) >= 3, 120, "the join after the exec restart")
        sup.events.flush()
    finally:
        sup.shutdown("test", grace_s=30)
    events = read_events(ctx.store, ctx.keys)
    starts = [e for e in events
              if e.get("source") == "supervisor" and e["kind"] == "start" and e.get("learner") == name]
    assert [e.get("forked") for e in starts] == [True, True, False]
    assert any(e["kind"] == "zygote_failed" for e in events)
    assert not any(e["kind"] == "standby" for e in events)
    assert_no_children()


def test_a_stop_request_ends_the_supervised_run(tmp_path: Path) -> None:
    """`diloco stop` on a local run: the supervisor ends (it does not restart the roles that exited)."""
    from diloco.run.signals import request_stop

    cfg = load_config("tiny").with_overrides({"run.num_learners": 1, "run.num_versions": 1_000_000})
    ctx = create_run(open_store(f"file://{tmp_path}/store"), "stopped", cfg)
    sup = local_supervisor(ctx, log_dir=str(tmp_path / "logs"),
                           env={"OMP_NUM_THREADS": "1", "DILOCO_LOCAL_DIR": str(tmp_path / "local")})
    try:
        sup.start_all()
        wait_for(lambda: joins(ctx, ctx.learners[0]), 120, "the join")
        request_stop(ctx, "operator")
        t0 = time.time()
        assert sup.run(tick_s=0.2) == "stop requested"
        assert time.time() - t0 < 10
    finally:
        sup.shutdown("stop requested", grace_s=30)
    restarts = [e for e in read_events(ctx.store, ctx.keys) if e["kind"] == "restart"]
    assert restarts == []
    assert_no_children()

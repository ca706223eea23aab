"""Warm standby: a learner's spare process waits, imports done, without touching the bucket; a
(re)start activates it, it joins the newest version; a dead spare is respawned; shutdown kills spares.
Run: `.venv/bin/pytest -m chaos tests/chaos/test_standby.py` (about 30 s on 2 cores).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from chaos_harness import assert_no_children, wait_for

from diloco.configs import load_config
from diloco.run.create import create_run
from diloco.run.events import read_events
from diloco.run.objects import write_state
from diloco.storage import commit, open_store, read_manifest
from diloco.storage.keys import new_nonce
from diloco.supervise import local as supervisor_module
from diloco.supervise.local import local_supervisor

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def snapshot(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in root.rglob("*") if p.is_file()}


def test_standby_activation_joins_newest_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_module, "JOIN_WAIT_S", 0.0)
    cfg = load_config("tiny").with_overrides({"run.num_learners": 1, "run.num_versions": 1_000_000,
                                              "run.restart_backoff_s": 0.1, "run.start_method": "exec"})
    root = tmp_path / "store"
    ctx = create_run(open_store(f"file://{root}"), "standby", cfg)
    logs = tmp_path / "logs"
    sup = local_supervisor(ctx, log_dir=str(logs), env={"OMP_NUM_THREADS": "1"})
    backend = sup.backend
    proc = sup.add("learner", ctx.learners[0])
    try:
        backend.spawn_standby(proc)
        log_file = logs / f"{proc.name}.log"
        wait_for(lambda: log_file.exists() and "standby ready" in log_file.read_text(), 120,
                 "the spare to warm up")
        before = snapshot(root)
        time.sleep(1.5)
        assert snapshot(root) == before, "a standby wrote to the bucket before it was activated"
        assert not any("status" in k or "/events/" in k for k in before)
        # a newer version than the spare could have seen when it started: it must join this one
        v0 = read_manifest(ctx.store, ctx.keys, 0)
        zeros = {e["name"]: torch.zeros(e["shape"]) for e in ctx.layout}  # an update that changes nothing
        key = ctx.keys.update(1, new_nonce())
        _, checksum = write_state(ctx.store, key, zeros, kind="update", fingerprint=ctx.fingerprint)
        commit(ctx.store, ctx.keys, v0.model_copy(update={"version": 1, "parent": 0, "update_key": key,
                                                          "update_checksum": checksum,
                                                          "created_at": time.time()}))
        spare_pid = backend.standbys[proc.name].pid
        sup.start(proc)
        assert proc.handle is not None and proc.handle.pid == spare_pid and proc.name not in backend.standbys
        sup.events.flush()
        joins = wait_for(lambda: [e for e in read_events(ctx.store, ctx.keys)
                                  if e.get("kind") == "join" and e.get("source") == proc.name],
                         60, "the join")
        assert joins[0]["version"] == 1
        # the next spare is started; one that dies is respawned
        sup.heal()
        assert proc.name in backend.standbys and backend.standbys[proc.name].pid != spare_pid
        dead = backend.standbys[proc.name].pid
        os.killpg(dead, signal.SIGKILL)
        wait_for(lambda: (sup.heal(),
                          proc.name in backend.standbys and backend.standbys[proc.name].pid != dead)[1], 10,
                 "a dead spare to be respawned")
    finally:
        sup.shutdown("test", grace_s=30)
    events = read_events(ctx.store, ctx.keys)
    starts = [e for e in events if e.get("source") == "supervisor" and e["kind"] == "start"]
    assert [e.get("standby") for e in starts] == [True]
    ends = {e.get("how") for e in events if e["kind"] == "standby_end"}
    assert {"activated", "died", "stopped"} <= ends
    assert_no_children()

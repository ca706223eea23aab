"""Signals to `diloco run` (local processes, forked from a zygote or exec'd), as `docker stop`, systemd, CI
timeouts and Ctrl-C send them: SIGTERM / SIGINT end every process of the run, record the true stop reason,
print the summary so far and exit 143 / 130, and the history audits clean; a second `diloco run` of the live
run is refused; a supervisor killed with SIGKILL leaves no role training — each notices its lease stopped
moving (run.heartbeat_timeout_s) and ends, recording why. The Prefect variants:
tests/deployment/test_signals_prefect.py.

Run: .venv/bin/pytest tests/chaos/test_signals.py   (real processes, ~3 min on 2 cores)
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from run_signals import (
    HEARTBEAT_TIMEOUT_S,
    audit_ok,
    check_signal_ends_the_run,
    processes_of,
    start_run,
    training,
    wait_for,
    write_config,
)

from diloco.run.context import open_run
from diloco.run.signals import read_stop_reason
from diloco.storage.records import LearnerStatus, read_record

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(900)]


# make test: both signals, both start methods (7-11 s each on an idle 2-core machine)
@pytest.mark.parametrize("method, sig", [("fork", signal.SIGTERM), ("fork", signal.SIGINT),
                                         ("exec", signal.SIGTERM), ("exec", signal.SIGINT)],
                         ids=["fork-term", "fork-int", "exec-term", "exec-int"])
def test_a_signal_ends_every_process_of_the_run(tmp_path: Path, method: str, sig: int) -> None:
    run_id = f"sig-{method}-{int(sig)}"
    config = write_config(tmp_path, start_method=method)
    proc = start_run(tmp_path, config, run_id)
    try:
        wait_for(lambda: training(tmp_path, run_id), 300, "version 2 and both learners joined")
        if (method, sig) == ("fork", signal.SIGTERM):  # a second supervisor of the live run is refused
            second = start_run(tmp_path, config, run_id)
            _, err = second.communicate(timeout=120)
            assert second.returncode == 2 and "already supervised by pid" in err, err
        ctx = check_signal_ends_the_run(tmp_path, proc, run_id, sig)
    finally:
        if proc.poll() is None:
            proc.kill()
    for name in ctx.learners:  # each ended its loop and said so
        assert read_record(ctx.store, ctx.keys.status(name), LearnerStatus).state == "stopped"


def test_a_killed_supervisor_leaves_no_role_training(tmp_path: Path) -> None:
    run_id = "sig-kill"
    proc = start_run(tmp_path, write_config(tmp_path), run_id)
    try:
        wait_for(lambda: training(tmp_path, run_id), 300, "version 2 and both learners joined")
        proc.kill()  # SIGKILL: no handler, no shutdown, no control/stop from the supervisor
        proc.wait(timeout=30)
        # each role ends once the lease has not moved for HEARTBEAT_TIMEOUT_S (plus its phase and checks)
        wait_for(lambda: not processes_of(run_id), HEARTBEAT_TIMEOUT_S * 8, "the orphaned roles to stop")
    finally:
        if proc.poll() is None:
            proc.kill()
    ctx = open_run(f"file://{tmp_path}/runs", run_id)
    reason = read_stop_reason(ctx)
    assert (reason and reason.startswith("supervisor lost")
            and f"not renewed for {HEARTBEAT_TIMEOUT_S:g} s" in reason)
    for name in ctx.learners:
        assert read_record(ctx.store, ctx.keys.status(name), LearnerStatus).state == "stopped"
    audit_ok(tmp_path, run_id)

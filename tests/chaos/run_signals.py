"""Signal checks shared by the local (tests/chaos/test_signals.py) and Prefect
(tests/deployment/test_signals_prefect.py) paths: a `diloco run` as a user starts it, and what must hold
after a signal (exit code, stop reason, summary, no process left, audit ok).

Not a test module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

from diloco.configs import load_config
from diloco.run.context import RunContext, RunError, open_run
from diloco.run.signals import read_stop_reason
from diloco.storage import StorageError, latest_version

HEARTBEAT_TIMEOUT_S = 15.0


def write_config(tmp_path: Path, **run: object) -> Path:
    """tiny, 2 learners, a target far away (the test ends the run), the run in tmp_path/runs."""
    cfg = load_config("tiny").with_overrides({
        "run.num_learners": 2, "run.num_versions": 100_000, "run.time_limit_s": 600,
        "run.heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "run.storage": f"file://{tmp_path}/runs",
        **{f"run.{k}": v for k, v in run.items()}})
    path = tmp_path / "signals.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def start_run(tmp_path: Path, config: Path, run_id: str, env: dict[str, str | None] | None = None,
              prefect: bool = False) -> subprocess.Popen:
    """`diloco run` in tmp_path; `env` adds variables to this process's (None: removes one)."""
    cmd = [sys.executable, "-m", "diloco.cli", "run", "--config", str(config), "--run-id", run_id,
           "--no-live", "--json", "--prefect" if prefect else "--no-prefect"]
    full = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(env or {})}
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in full.items() if v is not None})


def wait_for(check, timeout_s: float, what: str) -> None:
    """A generous bound on a hang, not a timed assertion."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def training(tmp_path: Path, run_id: str) -> bool:
    """Version 2 is committed and every learner has joined (written a status)."""
    try:
        ctx = open_run(f"file://{tmp_path}/runs", run_id)
        return (latest_version(ctx.store, ctx.keys) or 0) >= 2 and all(
            ctx.store.exists(ctx.keys.status(name)) for name in ctx.learners)
    except (RunError, StorageError):  # not created yet
        return False


def processes_of(run_id: str) -> list[str]:
    """Command lines of live processes of the run (roles, zygote and forks carry --run-id in theirs)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.pid != os.getpid() and run_id in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{proc.pid}: {cmdline}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def audit_ok(tmp_path: Path, run_id: str) -> None:
    done = subprocess.run([sys.executable, "-m", "diloco.cli", "audit", "--storage",
                           f"file://{tmp_path}/runs",
                           "--run-id", run_id, "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["ok"]


def check_signal_ends_the_run(tmp_path: Path, proc: subprocess.Popen, run_id: str, sig: int) -> RunContext:
    """Signal a live `diloco run`, then: its exit code, the stop reason, the summary, nothing left, audit
    ok."""
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    reason = {signal.SIGTERM: "terminated", signal.SIGINT: "interrupted"}[sig]
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    assert (f"{reason} (signal {int(sig)}) at version" in err
            and "every process of the run has ended" in err), err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["run_id"] == run_id and summary["initial_eval_loss"] is not None
    assert summary["extra"]["state"] == "stopped" and summary["extra"]["stop_reason"] == reason
    assert f"continue with: diloco resume --run-id {run_id}" in err
    ctx = open_run(f"file://{tmp_path}/runs", run_id)
    assert read_stop_reason(ctx) == reason
    wait_for(lambda: not processes_of(run_id), 30, "the run's processes to be gone")
    assert not processes_of(run_id), processes_of(run_id)
    audit_ok(tmp_path, run_id)
    return ctx



"""Bad input and unreachable storage on the command line: one line naming the problem, exit code 2, no
traceback, nothing written — an S3 endpoint that is down says "retrying" at once and gives up within its
retry window (DILOCO_STORAGE_RETRY_WINDOW_S; the bound is asserted through the attempts, not wall time).

Run: .venv/bin/pytest tests/integration/test_cli_errors.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.configs import load_config
from diloco.run.create import create_run
from diloco.storage import open_store


def _diloco(*args: str, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})}, cwd=cwd)


def _one_line_error(done: subprocess.CompletedProcess, needle: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: connections are refused


def test_an_unreachable_endpoint_retries_aloud_and_gives_up_within_its_window(tmp_path: Path) -> None:
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "y", "DILOCO_STORAGE_RETRY_WINDOW_S": "2"}
    done = _diloco("status", "--storage", "s3://bucket/runs", "--run-id", "r", env=env)
    _one_line_error(done, "Could not connect")
    retries = [line for line in done.stderr.splitlines() if "retrying (attempt" in line]
    assert retries and "retrying (attempt 2 of 6, next in" in retries[0], done.stderr
    assert len(retries) <= 5  # bounded: max_retries=5, and fewer when the window closes first


def test_unsupported_protocol_missing_config_and_unknown_learner(tmp_path: Path) -> None:
    _one_line_error(_diloco("run", "--config", "tiny", "--storage", "ftp://x/y"), "'ftp://' is not supported")
    _one_line_error(_diloco("run", "--config", str(tmp_path / "missing.yaml")), "does not exist")
    _one_line_error(_diloco("run", "--config", "nope"), "neither a recipe")
    url = f"file://{tmp_path}/bucket"
    create_run(open_store(url), "r1", load_config("tiny").with_overrides({"run.num_learners": 2}))
    _one_line_error(_diloco("remove-learner", "--storage", url, "--run-id", "r1", "--learner", "local-7"),
                    "'local-7' is not in run 'r1' (its learners: local-0, local-1)")
    assert not (tmp_path / "bucket" / "r1" / "control").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_cuda_learners_on_a_machine_without_cuda_are_refused_before_anything_is_written(
        tmp_path: Path) -> None:
    """Before, the run was created and every learner crashed max_restarts times, found on no GPU at all."""
    url = f"file://{tmp_path}/bucket"
    _one_line_error(_diloco("run", "--config", "tiny", "--storage", url, "--no-prefect", "-o",
                            "learner.device=cuda"),
                    "learner.device is 'cuda', but this machine has no CUDA device")
    assert not (tmp_path / "bucket").exists()


@pytest.mark.parametrize("command", ["status", "audit", "plot", "stop", "summary", "runs"])
def test_every_command_defaults_to_file_runs(tmp_path: Path, command: str) -> None:
    """--storage defaults to file://runs (in the current folder) for every command."""
    args = [command] if command == "runs" else [command, "--run-id", "absent"]
    done = _diloco(*args, cwd=tmp_path)
    if command == "runs":
        assert done.returncode == 0 and "no runs in file://" in done.stdout, done.stdout + done.stderr
    else:
        _one_line_error(done, f"no run 'absent' in file://{tmp_path}/runs")


def test_a_run_refused_after_its_early_prefect_server_launched_leaves_none(tmp_path: Path) -> None:
    """`diloco run` launches its local Prefect server before the engine's imports (diloco.flows.server
    launch_early); a run refused after that (here: its storage) stops it again."""
    import psutil

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    done = subprocess.run([sys.executable, "-m", "diloco.cli", "run", "--config", "tiny", "--storage",
                           "ftp://x/y"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    _one_line_error(done, "'ftp://' is not supported")
    assert (tmp_path / ".diloco" / "prefect").is_dir()  # the server was launched: its home exists
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "server" in (proc.info["cmdline"] or []) and Path(proc.cwd()) == tmp_path:
                left.append(proc.info["cmdline"])
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    assert not left, left

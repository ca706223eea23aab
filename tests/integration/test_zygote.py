"""The zygote forks real roles through the launch entry (diloco.launch): own session, own log, the given
environment, exit codes.

Run: .venv/bin/pytest tests/integration/test_zygote.py
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from diloco.configs import load_config
from diloco.run.create import create_run
from diloco.storage import open_store
from diloco.supervise.zygote import Zygote


@pytest.fixture(scope="module")
def zygote():
    z = Zygote({**os.environ, "OMP_NUM_THREADS": "1"}, "--run-id=test-zygote")
    yield z
    z.close()
    assert z.proc.returncode == 0  # it exits on end of input


def _run(tmp_path: Path) -> str:
    url = f"file://{tmp_path}/store"
    create_run(open_store(url), "zy", load_config("tiny").with_overrides({"run.num_learners": 2}))
    return url


def test_a_forked_learner_takes_its_env_and_log_and_exits_0(zygote: Zygote, tmp_path: Path) -> None:
    url, local = _run(tmp_path), tmp_path / "local"
    log = tmp_path / "learner.log"
    env = {**os.environ, "DILOCO_LOCAL_DIR": str(local)}
    child = zygote.spawn(["learner", "--storage", url, "--run-id", "zy", "--name", "local-0", "--phases", "1",
                          "-v"], str(log), env, "local-0")
    assert child.wait(timeout=120) == 0, log.read_text()
    assert child.pid not in (zygote.proc.pid, os.getpid())
    assert "joined at version 0" in log.read_text()
    assert any(local.rglob("state.bin")), "DILOCO_LOCAL_DIR from the request was not used"
    assert any((tmp_path / "store").rglob("deltas/local-0/*")), "the forked learner published nothing"


def test_a_usage_error_is_the_commands_exit_code(zygote: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "bad.log"
    bad = zygote.spawn(["learner", "--storage", "file:///x", "--run-id", "r", "--phases", "zero"], str(log),
                       dict(os.environ), "bad")
    assert bad.wait(timeout=60) == 2
    assert "invalid int value: 'zero'" in log.read_text()


def test_a_child_has_its_own_session_and_its_sigkill_is_reported(zygote: Zygote, tmp_path: Path) -> None:
    url = _run(tmp_path)
    # the evaluator of a live run polls for versions until control/stop: it runs until killed
    child = zygote.spawn(["evaluator", "--storage", url, "--run-id", "zy"],
                         str(tmp_path / "eval.log"), dict(os.environ), "evaluator")
    time.sleep(1.0)
    assert child.poll() is None, (tmp_path / "eval.log").read_text()
    assert os.getsid(child.pid) == child.pid  # killpg reaches it and nothing else
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert zygote.alive
    again = zygote.spawn(["--help"], None, dict(os.environ), "help")
    assert again.wait(timeout=60) == 0

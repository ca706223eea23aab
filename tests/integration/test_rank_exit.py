"""A rank that ended well exits 0 even when its parent process holds at-exit hooks that fail in a fork: a
learner run as a Prefect flow (`diloco run`'s default) holds Prefect's services, whose drain at exit fails in
a forked rank (an AssertionError in multiprocessing's teardown, exit code 1), so every multi-rank learner was
reported failed and restarted as its run ended, and torch ended its other ranks mid-close.

Run: .venv/bin/pytest tests/integration/test_rank_exit.py   (a few seconds)
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os
import threading

from diloco.learner.world import launch_world


def fails_in_a_fork():
    raise AssertionError("the parent's at-exit hook ran in a rank")


threading._register_atexit(fails_in_a_fork)  # as Prefect's services register theirs
launch_world(lambda world: None, 2, cuda=False, timeout_s=60.0)
print("ranks ended well", flush=True)
os._exit(0)  # the hook above is this process's too: not run here either
"""


def test_ranks_that_ended_well_exit_zero_under_failing_inherited_exit_hooks() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ranks ended well" in done.stdout

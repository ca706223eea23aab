"""Fixtures of the deployment tests: one real Prefect stack and one deployed training run per session.

The same `deployed_run` fixture serves tests/browser (prefect_stack keeps it in config.stash).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "chaos"))  # removal.py, shared with tests/chaos

# the shared fixture, and the hook that stops its stack after the last test sharing it
from prefect_stack import deployed_run, pytest_runtest_teardown  # noqa: E402, F401

"""tests/chaos: each test's start time, for chaos_harness.assert_no_children, which counts only the processes
started since. A process a session fixture started before (the Prefect server that tests/browser and
tests/deployment share, when they run first) is not the run's."""

from __future__ import annotations

import time

import chaos_harness
import pytest


@pytest.fixture(autouse=True)
def _test_started() -> None:
    chaos_harness.TEST_STARTED = time.time()

"""Fixtures of the browser tests: the deployed run of tests/deployment (one per session), and Chromium.

Chromium comes from the system (`apt-get install chromium`; .ci/run does it); without it the tests skip.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "deployment"))

# the shared session fixture, and the hook that stops its stack after the last test sharing it
from prefect_stack import deployed_run, pytest_runtest_teardown  # noqa: E402, F401

CHROMIUM_PATHS = ("/usr/lib/chromium/chromium", "/usr/bin/chromium", "/usr/bin/chromium-browser")


@pytest.fixture(scope="session")
def chromium() -> str:
    """The system Chromium's path, or skip (checked before the expensive deployed run starts)."""
    for path in (*CHROMIUM_PATHS, shutil.which("chromium") or ""):
        if path and Path(path).is_file():
            return path
    pytest.skip("chromium is not installed: `apt-get install -y --no-install-recommends chromium` "
                "(.ci/run installs it)")

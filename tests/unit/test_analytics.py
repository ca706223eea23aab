"""Prefect's usage analytics are off in `make run` as in `make test`, and for every `diloco` command: the
server's setting and the SDK's DO_NOT_TRACK (Prefect 3.9 prints a telemetry notice through the live table
without it); a value the environment sets wins.

Run: .venv/bin/pytest tests/unit/test_analytics.py -q
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from diloco.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_make_run_turns_analytics_off_as_make_test_does() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in ("run", "test"):
        recipe = re.search(rf"^{target}: .*\n\t(.+)$", makefile, re.M)
        assert recipe and "PREFECT_SERVER_ANALYTICS_ENABLED=false" in recipe.group(1), target


@pytest.mark.parametrize("preset", [None, "0"])
def test_the_command_sets_do_not_track_unless_the_environment_does(monkeypatch, preset: str | None) -> None:
    for name in ("DO_NOT_TRACK", "PREFECT_SERVER_ANALYTICS_ENABLED"):
        monkeypatch.setenv(name, "x")  # recorded, so the test's end restores the environment as it was
        monkeypatch.delenv(name)
    if preset is not None:
        monkeypatch.setenv("DO_NOT_TRACK", preset)
    monkeypatch.setattr(sys, "argv", ["diloco", "--help"])
    with pytest.raises(SystemExit):
        main()
    assert os.environ["DO_NOT_TRACK"] == (preset or "1")
    assert os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"

"""`diloco ui` reopens the project's local Prefect server after its runs ended: the UI it serves points its
pages at the right API (GET /ui-settings says so), a live server of the same home is reported rather than
doubled, and Ctrl-C stops it — nothing left running.

Run: .venv/bin/pytest tests/deployment/test_ui_command.py   (starts one Prefect server: the command under
test)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.deployment, pytest.mark.timeout(600)]


def _get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - loopback
        return json.loads(r.read())


def test_ui_serves_the_right_api_url_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    home = tmp_path / ".diloco" / "prefect"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_UI_API_URL")}
    env["PREFECT_API_URL"] = "http://127.0.0.1:1/api"  # a stale one in the user's shell must not leak in
    proc = subprocess.Popen([sys.executable, "-m", "diloco.cli", "ui", "--port", "0", "--home", str(home)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=tmp_path)
    try:
        lines: list[str] = []
        deadline = time.time() + 240
        while time.time() < deadline and not any("Prefect UI http" in line for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "diloco ui ended:\n" + "".join(lines)
            lines.append(line)
        match = re.search(r"Prefect UI (http://127\.0\.0\.1:\d+) \(API (http://127\.0\.0\.1:\d+/api)\)",
                          "".join(lines))
        assert match, "".join(lines)
        ui, api = match.groups()
        assert api == f"{ui}/api"
        assert _get_json(f"{api}/health") is True
        assert _get_json(f"{ui}/ui-settings")["api_url"] == api  # the pages talk to this server
        again = subprocess.run([sys.executable, "-m", "diloco.cli", "ui", "--home", str(home)],
                               capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert again.returncode == 0 and f"is up (a run is using it): UI {ui}" in again.stdout, again.stdout
        server_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert not [p for p in server_pids
                if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not (home / "server.json").exists()

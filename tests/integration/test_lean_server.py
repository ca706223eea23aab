"""The embedded Prefect server (make run, `diloco run`, `diloco ui`) runs only the services local runs need.

A real `prefect server start`, asked for its own settings (`GET /api/admin/settings`).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from diloco.flows.server import LEAN_SERVICES, start_server, stop_api


def test_the_embedded_server_is_lean_and_a_setting_in_the_environment_wins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED", "true")  # a user who wants automations
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    url, proc = start_server(tmp_path / "prefect")
    try:
        with urllib.request.urlopen(f"{url}/admin/settings", timeout=30) as answer:  # noqa: S310 - loopback
            services = json.load(answer)["server"]["services"]
    finally:
        stop_api(proc, flush=False)
    enabled = {name: value.get("enabled") for name, value in services.items() if isinstance(value, dict)}
    assert enabled["event_persister"] and enabled["task_run_recorder"], enabled  # what the UI shows
    assert enabled["triggers"] is True, enabled  # the environment's value, not the lean default
    off = [name.lower() for name in LEAN_SERVICES if name != "TRIGGERS"]
    assert not any(enabled[name] for name in off), enabled
    assert (tmp_path / "prefect" / "server.log").is_file()

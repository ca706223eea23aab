"""The embedded Prefect server (make run, `diloco run`, `diloco ui`) runs only the services local runs need,
and its SQLite writes wait for each other instead of failing.

A real `prefect server start` (flows/prefect_server), asked for its own settings (`GET /api/admin/settings`)
and sent a burst of concurrent writes over HTTP.
"""

from __future__ import annotations

import collections
import json
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from diloco.flows.server import LEAN_SERVICES, start_server, stop_api


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("prefect")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED", "true")  # a user who wants automations
        env.delenv("PREFECT_API_URL", raising=False)
        url, proc = start_server(home)
    try:
        yield url, home
    finally:
        stop_api(proc, flush=False)


def test_the_embedded_server_is_lean_and_a_setting_in_the_environment_wins(server: tuple[str, Path]) -> None:
    url, home = server
    with urllib.request.urlopen(f"{url}/admin/settings", timeout=30) as answer:  # noqa: S310 - loopback
        services = json.load(answer)["server"]["services"]
    enabled = {name: value.get("enabled") for name, value in services.items() if isinstance(value, dict)}
    assert enabled["event_persister"] and enabled["task_run_recorder"], enabled  # what the UI shows
    assert enabled["triggers"] is True, enabled  # the environment's value, not the lean default
    off = [name.lower() for name in LEAN_SERVICES if name != "TRIGGERS"]
    assert not any(enabled[name] for name in off), enabled
    assert (home / "server.log").is_file()


def test_concurrent_writes_wait_for_the_lock_instead_of_answering_503(server: tuple[str, Path]) -> None:
    """Eight clients at once, as the roles of a run start: each creates a flow run, then task runs and their
    states, with no client retries. Prefect's own DEFERRED transactions answered 503 ("database is locked")
    to 3-40 of such a burst's writes in every try on this 2-core machine; begun IMMEDIATE, none."""
    url, _ = server
    with httpx.Client(base_url=url, timeout=60) as client:
        flow_id = client.post("/flows/", json={"name": "burst"}).raise_for_status().json()["id"]
    codes: collections.Counter[int] = collections.Counter()
    start, tally = threading.Barrier(8), threading.Lock()

    def role() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            seen: list[int] = []
            start.wait()
            flow_run = client.post("/flow_runs/", json={"flow_id": flow_id, "name": uuid.uuid4().hex[:12]})
            seen.append(flow_run.status_code)
            for i in range(12 if flow_run.status_code == 201 else 0):
                task_run = client.post("/task_runs/",
                                       json={"flow_run_id": flow_run.json()["id"], "name": f"t{i}",
                                             "task_key": "phase", "dynamic_key": str(i)})
                seen.append(task_run.status_code)
                if task_run.status_code == 201:
                    seen.append(client.post(f"/task_runs/{task_run.json()['id']}/set_state",
                                            json={"state": {"type": "RUNNING"}}).status_code)
        with tally:  # Counter's += is not atomic across threads
            codes.update(seen)

    threads = [threading.Thread(target=role) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert dict(codes) == {201: 8 + 8 * 12, 200: 8 * 12}, dict(codes)

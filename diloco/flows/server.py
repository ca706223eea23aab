"""A local Prefect API for the embedded default: reuse PREFECT_API_URL, or start `prefect server`.

Contract: after ensure_api() returns, PREFECT_API_URL is set in this process's environment (so
child processes report to the same API); the server it started is stopped by stop_api(). A started server
is recorded in <home>/server.json (its URL and pid) while it runs, so `diloco ui` finds a live one rather
than start a second server on the same database.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

STARTUP_TIMEOUT_S = 90.0
SERVER_RECORD = "server.json"  # in the server's home, while it runs
_RECORDS: dict[int, Path] = {}  # pid of a server started here -> its record, removed when it is stopped


def running_server(home: Path) -> str | None:
    """The API URL of a live server started from this home (its record, and it answers), else None."""
    try:
        record = json.loads((home / SERVER_RECORD).read_text())
    except (OSError, ValueError):
        return None
    url = record.get("api_url") if isinstance(record, dict) else None
    return url if isinstance(url, str) and healthy(url) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as r:  # noqa: S310 - loopback
            return r.status == 200
    except OSError:
        return False


def start_server(home: Path, port: int | None = None, log_path: Path | None = None) -> tuple[str, subprocess.Popen]:
    """Start `prefect server start` on a free loopback port with its own PREFECT_HOME."""
    port = port or free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_API_PORT": str(port),
           "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api"}
    env.pop("PREFECT_API_URL", None)
    prefect = str(Path(sys.executable).with_name("prefect"))
    out = open(log_path or home / "server.log", "ab")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + STARTUP_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}; see {out.name}")
        if healthy(url):
            _RECORDS[proc.pid] = home / SERVER_RECORD
            (home / SERVER_RECORD).write_text(json.dumps({"api_url": url, "pid": proc.pid}))
            return url, proc
        time.sleep(0.3)
    stop_api(proc)
    raise RuntimeError(f"prefect server did not answer on {url} within {STARTUP_TIMEOUT_S:.0f}s")


def ensure_api(home: Path) -> tuple[str, subprocess.Popen | None]:
    """The API to report to: PREFECT_API_URL if set, else a server started here."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return url, None
    url, proc = start_server(home)
    os.environ["PREFECT_API_URL"] = url
    return url, proc


def flush_prefect(timeout_s: float = 10.0) -> None:
    """Send this process's buffered Prefect logs and events now, while the API still answers."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        # best effort at shutdown: the run itself is done, a lost log line is not worth a crash
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout_s)


def stop_api(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    record = _RECORDS.pop(proc.pid, None)
    if record is not None:
        with contextlib.suppress(OSError):
            record.unlink()
    if proc.poll() is not None:
        return
    flush_prefect()
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

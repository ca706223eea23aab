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
from collections.abc import Iterator
from pathlib import Path

STARTUP_TIMEOUT_S = 90.0
SERVER_RECORD = "server.json"  # in the server's home, while it runs
_RECORDS: dict[int, Path] = {}  # pid of a server started here -> its record, removed when it is stopped
_EARLY: dict[Path, tuple[str, subprocess.Popen]] = {}  # home -> a server launched before ensure_api took it


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


# The embedded server (make run, `diloco run`, `diloco ui`) serves one machine's local runs: flow runs forked
# from the zygote, no deployments, workers, schedules, pauses, concurrency limits or automations. So it runs
# only the services the UI needs (the event persister and the task-run recorder) and skips the block-type
# registration at start (with its memo check, which imports every installed Prefect collection): its API
# answers ~3 s sooner and it spends ~5 s less CPU in a make run (docs/LIFECYCLE.md). A value set in the
# environment wins; `lean=False` (the deployment tests' stack, with real workers) keeps Prefect's defaults.
LEAN_SERVICES = ("SCHEDULER", "LATE_RUNS", "FOREMAN", "CANCELLATION_CLEANUP", "PAUSE_EXPIRATIONS",
                 "REPOSSESSOR", "TRIGGERS", "CLEANUP_RECONCILER")
LEAN_SETTINGS = {**{f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in LEAN_SERVICES},
                 "PREFECT_API_BLOCKS_REGISTER_ON_START": "false",
                 "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false"}


def launch_server(home: Path, port: int | None = None, log_path: Path | None = None,
                  lean: bool = True) -> tuple[str, subprocess.Popen]:
    """Start `prefect server start` (through flows/prefect_server: its SQLite writes wait for the lock, not
    503) on a free loopback port with its own PREFECT_HOME; returns at once (its API URL is known before it
    answers: wait_healthy waits for it). lean: LEAN_SETTINGS, unless set."""
    port = port or free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = {**(LEAN_SETTINGS if lean else {}), **os.environ, "PREFECT_HOME": str(home),
           "PREFECT_SERVER_API_PORT": str(port),
           "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api"}
    env.pop("PREFECT_API_URL", None)
    with open(log_path or home / "server.log", "ab") as out:  # the child keeps its own copy
        proc = subprocess.Popen([sys.executable, "-m", "diloco.flows.prefect_server", "server", "start",
                                 "--host", "127.0.0.1", "--port", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    _RECORDS[proc.pid] = home / SERVER_RECORD
    return f"http://127.0.0.1:{port}/api", proc


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Block until the launched server answers (then record it in its home), or stop it and raise."""
    deadline = time.time() + timeout_s
    record = _RECORDS.get(proc.pid)
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}; see its server.log")
        if healthy(url):
            if record is not None:
                record.write_text(json.dumps({"api_url": url, "pid": proc.pid}))
            return
        time.sleep(0.3)
    stop_api(proc)
    raise RuntimeError(f"prefect server did not answer on {url} within {timeout_s:.0f}s")


def start_server(home: Path, port: int | None = None, log_path: Path | None = None,
                 lean: bool = True) -> tuple[str, subprocess.Popen]:
    """launch_server, then wait until it answers."""
    url, proc = launch_server(home, port, log_path, lean)
    wait_healthy(url, proc)
    return url, proc


def launch_early(home: Path) -> None:
    """Launch the local server now, when one will be needed (PREFECT_API_URL unset), for ensure_api to take:
    its ~6 s boot then overlaps the command's own imports and the run's creation. close_early stops it if
    nothing took it (the command failed first)."""
    if not os.environ.get("PREFECT_API_URL") and home not in _EARLY:
        _EARLY[home] = launch_server(home)


def close_early(home: Path) -> None:
    """Stop a server launch_early started that ensure_api did not take (nothing reported to it: no flush)."""
    early = _EARLY.pop(home, None)
    if early is not None:
        stop_api(early[1], flush=False)


def ensure_api(home: Path, wait: bool = True) -> tuple[str, subprocess.Popen | None]:
    """The API to report to: PREFECT_API_URL if set, else a server started here, or the one launch_early
    started (set in PREFECT_API_URL at once, so processes started while it boots report to it; wait=False:
    call wait_healthy before use)."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return url, None
    url, proc = _EARLY.pop(home, None) or launch_server(home)
    os.environ["PREFECT_API_URL"] = url
    if wait:
        wait_healthy(url, proc)
    return url, proc


@contextlib.contextmanager
def api_settings(api_url: str) -> Iterator[None]:
    """This process's Prefect settings pointed at api_url. Prefect reads its settings when it is imported,
    so setting PREFECT_API_URL afterwards reaches child processes only: an in-process flow would start (and
    report to) a temporary server of its own, ~8 s, and its runs would not be where the roles' are."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        yield


def flush_prefect(timeout_s: float = 10.0) -> None:
    """Send this process's buffered Prefect logs and events now, while the API still answers."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        # best effort at shutdown: the run itself is done, a lost log line is not worth a crash
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout_s)


def stop_api(proc: subprocess.Popen | None, flush: bool = True) -> None:
    """Stop a server started here (its record removed); flush=True sends this process's Prefect logs and
    events to it first."""
    if proc is None:
        return
    record = _RECORDS.pop(proc.pid, None)
    if record is not None:
        with contextlib.suppress(OSError):
            record.unlink()
    if proc.poll() is not None:
        return
    if flush:
        flush_prefect()
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

"""`diloco ui`: the project's local Prefect server, (re)opened for its UI after the runs that used it ended.

Contract: a live server of the same home (a run in progress) is reported, not doubled; otherwise a server is
started on the port asked for (or a free one if taken) with PREFECT_UI_API_URL pointing at itself, so the
UI's pages talk to the right API; it runs until SIGINT/SIGTERM and is stopped then.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from diloco.flows.server import free_port, running_server, start_server, stop_api


def pick_port(port: int) -> int:
    """`port` if it can be bound on the loopback now (0: none asked), else a free one."""
    if port:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                pass
    return free_port()


def serve_ui(home: Path, port: int = 4200, announce: Callable[[str], None] = print,
             until: Callable[[], bool] | None = None) -> str:
    """Serve the UI of `home` until a signal (or `until()`); returns the API URL it served."""
    from diloco.supervise.interrupt import catch_signals, received

    live = running_server(home)
    if live:
        announce(f"the local Prefect server is up (a run is using it): UI {live.removesuffix('/api')}, API "
                 f"{live}")
        return live
    if not (home / "prefect.db").exists() and not any(home.glob("*.db")):
        announce(f"(no runs have reported to {home} yet: the UI will be empty)")
    with catch_signals():
        url, proc = start_server(home, pick_port(port))
        try:
            announce(f"Prefect UI {url.removesuffix('/api')} (API {url}); Ctrl-C to stop")
            while proc.poll() is None and received() is None and not (until and until()):
                time.sleep(0.5)
        finally:
            stop_api(proc)
    return url

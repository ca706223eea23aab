"""The S3 server `bench wan --links real` puts on the host end of the links: moto's server (the one
tests/conftest.py starts), in a process of its own, listening on the bridge's address; and a fresh bucket in
it.

Contract: `s3_server(host)` yields the endpoint URL and the server's process once the server answers and sets
AWS_ENDPOINT_URL and moto's fake credentials in os.environ for its duration (forked learners inherit them),
restoring both and ending the server on exit. moto, because no S3-compatible server that runs here (MinIO,
SeaweedFS, Garage) is offered by the package registries this machine reaches: docs/BENCHMARKS.md ("Real
links"). moto's application is served by uvicorn (Prefect's HTTP server), which keeps HTTP/1.1 connections
open between requests as S3 does, not by moto's own werkzeug server, which answers every request with
`Connection: close`: a TCP handshake and teardown per request (200 GETs opened 200 connections, 7.1 packets
sent per GET), bytes and round trips a real bucket does not cost.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
START_TIMEOUT_S = 60.0  # moto's imports on a loaded 2-core box
# an idle connection is kept this long by the server: longer than the client's own idle limit (aiohttp's,
# 15 s by default), so the client closes it first and never sends on a connection the server is closing
KEEP_ALIVE_S = 60


def moto_app():
    """moto's WSGI application: every AWS service it fakes, by the request's host and path."""
    from moto.server import DomainDispatcherApplication, create_backend_app

    return DomainDispatcherApplication(create_backend_app)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(host: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """moto's S3 server on host:<free port>, in a process of its own (the test suite's too); yields (its
    endpoint URL, its process) once it answers, and ends it on exit. The environment is not touched."""
    port = _free_port(host)
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", f"{__name__}:moto_app", "--factory",
                             "--interface", "wsgi", "--host", host, "--port", str(port),
                             "--timeout-keep-alive", str(KEEP_ALIVE_S), "--log-level", "warning",
                             "--no-access-log"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
                break
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"moto's S3 server did not start on {host}:{port} (exit code "
                                   f"{proc.poll()})")
            time.sleep(0.2)
        yield f"http://{host}:{port}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def s3_server(host: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """moto_server, with AWS_ENDPOINT_URL and moto's credentials in os.environ for its duration."""
    from unittest import mock  # patch.dict: os.environ as it was on exit, added keys removed

    with moto_server(host) as (endpoint, proc), mock.patch.dict(os.environ, {"AWS_ENDPOINT_URL": endpoint,
                                                                            **CREDENTIALS}):
        for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
            os.environ.pop(k, None)
        yield endpoint, proc


def cpu_s(proc: subprocess.Popen) -> float | None:
    """CPU seconds (user + system) the server has used so far; None once it is gone."""
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def new_bucket(endpoint: str) -> str:
    """A fresh bucket on the server at `endpoint`; its name."""
    import boto3

    name = f"diloco-wan-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    client.create_bucket(Bucket=name)
    return name

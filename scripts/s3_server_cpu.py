"""The CPU an S3 server spends per request, for the servers `bench wan --links real` can use (moto, rclone
serve s3; docs/bench/wan.md): each started on 127.0.0.1, then through diloco's store (s3fs) 1,000 GETs of 20
kB objects, 500 PUTs of 20 kB and 500 listings of a 500-key folder; the server's CPU (user + system, /proc)
and the client's wall time per request.

Usage, from the repository root after `make setup`: .venv/bin/python scripts/s3_server_cpu.py [moto rclone]
"""

from __future__ import annotations

import os
import sys
import time

from diloco.bench._s3_server import CREDENTIALS, moto_server, new_bucket, rclone_server
from diloco.storage import open_store

HZ = os.sysconf("SC_CLK_TCK")
GETS, PUTS, LISTS, SIZE = 1000, 500, 500, 20_000


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def measure(name: str) -> None:
    serve = {"moto": moto_server, "rclone": rclone_server}[name]
    with serve("127.0.0.1") as (endpoint, proc):
        os.environ.update(AWS_ENDPOINT_URL=endpoint, **CREDENTIALS)
        store = open_store(f"s3://{new_bucket(endpoint)}/cpu")
        payload = os.urandom(SIZE)
        for i in range(20):
            store.put(f"read/{i}", payload)
        figures = []
        for label, n, request in (("GET 20 kB", GETS, lambda i: store.get(f"read/{i % 20}")),
                                  ("PUT 20 kB", PUTS, lambda i: store.put(f"write/{i:04d}", payload)),
                                  ("LIST 500 keys", LISTS, lambda i: store.list("write/"))):
            cpu0, t0 = cpu_s(proc.pid), time.perf_counter()
            for i in range(n):
                request(i)
            figures.append(f"{label}: {1e3 * (cpu_s(proc.pid) - cpu0) / n:.2f} ms server CPU, "
                           f"{1e3 * (time.perf_counter() - t0) / n:.2f} ms wall")
        print(f"{name:>6}: " + "; ".join(figures), flush=True)


if __name__ == "__main__":
    for server in sys.argv[1:] or ("moto", "rclone"):
        measure(server)

"""The CPU an S3 server spends per request, for the servers `bench wan --links real` can use (moto, rclone
serve s3; docs/bench/wan.md): each started on 127.0.0.1, then through diloco's store (s3fs) 1,000 GETs of 20
kB objects, 500 PUTs of 20 kB and 500 listings of a 500-key folder; the server's CPU (user + system)
and the client's wall time per request.

Usage, from the repository root after `make setup`: .venv/bin/python scripts/s3_server_cpu.py [moto rclone]
"""

from __future__ import annotations

import os
import sys
import time

from diloco.bench._s3_server import cpu_s, new_bucket, s3_server
from diloco.storage import open_store

GETS, PUTS, LISTS, SIZE = 1000, 500, 500, 20_000


def measure(name: str) -> None:
    with s3_server("127.0.0.1", name) as (endpoint, proc):  # AWS_ENDPOINT_URL and its credentials set
        store = open_store(f"s3://{new_bucket(endpoint)}/cpu")
        payload = os.urandom(SIZE)
        for i in range(20):
            store.put(f"read/{i}", payload)
        figures = []
        for label, n, request in (("GET 20 kB", GETS, lambda i: store.get(f"read/{i % 20}")),
                                  ("PUT 20 kB", PUTS, lambda i: store.put(f"write/{i:04d}", payload)),
                                  ("LIST 500 keys", LISTS, lambda i: store.list("write/"))):
            cpu0, t0 = cpu_s(proc), time.perf_counter()
            for i in range(n):
                request(i)
            figures.append(f"{label}: {1e3 * (cpu_s(proc) - cpu0) / n:.2f} ms server CPU, "
                           f"{1e3 * (time.perf_counter() - t0) / n:.2f} ms wall")
        print(f"{name:>6}: " + "; ".join(figures), flush=True)


if __name__ == "__main__":
    for server in sys.argv[1:] or ("moto", "rclone"):
        measure(server)

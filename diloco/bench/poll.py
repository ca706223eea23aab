"""`diloco bench poll`: what one merger poll costs against the number of deltas a run has accumulated.

Contract: for each N in --deltas, a fresh run prefix under the storage gets N delta keys spread over
--learners learners (tiny objects: a poll lists keys and reads none), all of them merged already (each
learner's cursor is its last seq) but one new delta per learner. Timed, median of --repeats: the listing the
merger made at every poll before 2026-12-05 (every key under deltas/, parsed) and the merger's `deltas_after`
now (the learners' folders, then each learner's keys after its cursor: S3's StartAfter). Both must find
exactly the new deltas. With --moto, moto's S3 server is started in a process of its own on a free port (the
test suite's server, diloco/bench/_s3_server.py; a dev dependency); else --storage (s3:// with
AWS_ENDPOINT_URL for a real endpoint, or file://; default a temporary folder). Prints a table; JSON
{"storage", "learners", "rows": [{"deltas", "full_listing_s", "after_cursor_s", "keys_full",
"keys_after_cursor"}], "version_rows": [...]}.

The same for the version listing every role's stop check, the evaluator's and the supervisor's polls make: for
each V in --versions, V manifest keys (tiny objects: the newest version is read from the listing), timed as
every poll made it before 2026-12-06 (a full listing of versions/) and as a ChainWatch makes it now (the
listing after the version it knows: one new version). Rows {"versions", "full_listing_s", "after_known_s",
"keys_full", "keys_after_known"}: both must find the newest version.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Annotated

from diloco.bench.harness import BenchResult, Opt, Table, benchmark
from diloco.configs import ConfigError
from diloco.merger.waiting import deltas_after
from diloco.storage import RunKeys, Store, latest_version, open_store
from diloco.storage.keys import parse_delta_key


def full_listing(store: Store, keys: RunKeys, cursors: dict[str, int]) -> dict[str, list[int]]:
    """The merger's poll before 2026-12-05: one recursive listing of deltas/, then the seqs after each
    cursor."""
    found: dict[str, list[int]] = {}
    for key in store.list(keys.deltas_prefix()):
        parsed = parse_delta_key(key)
        if parsed and parsed[1] > cursors.get(parsed[0], -1):
            found.setdefault(parsed[0], []).append(parsed[1])
    return found


class _Counting:
    """Counts the keys the listings return (the body a poll downloads)."""

    def __init__(self, store: Store) -> None:
        self.store, self.keys = store, 0

    def list(self, prefix: str, after: str = "") -> list[str]:
        out = self.store.list(prefix, after)
        self.keys += len(out)
        return out

    def folders(self, prefix: str) -> list[str]:
        out = self.store.folders(prefix)
        self.keys += len(out)
        return out


def _timed(fn, repeats: int) -> tuple[float, dict, int]:
    times, found, keys = [], {}, 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        found, keys = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), found, keys


def measure_row(store: Store, learners: int, deltas: int, repeats: int) -> dict:
    keys = RunKeys(f"poll-{uuid.uuid4().hex[:8]}")
    names = [f"learner-{i}" for i in range(learners)]
    per = max(deltas // learners, 1)
    todo = [keys.delta(n, seq) for n in names for seq in range(per)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: store.put(key, b"d"), todo))
    cursors = {n: per - 2 for n in names}  # everything merged but each learner's newest delta
    expected = {n: [per - 1] for n in names}

    def run(listing):
        counting = _Counting(store)
        found = listing(counting, keys, cursors)
        return {n: sorted(s) for n, s in found.items()}, counting.keys

    full_s, full_found, full_keys = _timed(lambda: run(full_listing), repeats)
    after_s, after_found, after_keys = _timed(lambda: run(deltas_after), repeats)
    if full_found != expected or after_found != expected:
        raise RuntimeError(f"the listings disagree: {full_found} / {after_found}, expected {expected}")
    return {"deltas": per * learners, "full_listing_s": round(full_s, 4), "after_cursor_s": round(after_s, 4),
            "keys_full": full_keys, "keys_after_cursor": after_keys}


def measure_versions(store: Store, versions: int, repeats: int) -> dict:
    """One stop check / poll of the newest version against a chain of `versions` versions: the full listing
    (before 2026-12-06) and the listing after the version the poller knows (ChainWatch: one new version)."""
    keys = RunKeys(f"poll-{uuid.uuid4().hex[:8]}")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda v: store.put(keys.manifest(v), b"{}"), range(versions)))

    def run(after):
        counting = _Counting(store)
        return latest_version(counting, keys, after=after), counting.keys

    full_s, full_found, full_keys = _timed(lambda: run(None), repeats)
    after_s, after_found, after_keys = _timed(lambda: run(versions - 2), repeats)
    if full_found != versions - 1 or after_found != versions - 1:
        raise RuntimeError(f"the listings disagree: {full_found} / {after_found}, expected {versions - 1}")
    return {"versions": versions, "full_listing_s": round(full_s, 4), "after_known_s": round(after_s, 4),
            "keys_full": full_keys, "keys_after_known": after_keys}


def _moto_endpoint(stack: ExitStack) -> str:
    from diloco.bench._s3_server import new_bucket, s3_server

    endpoint, _ = stack.enter_context(s3_server("127.0.0.1"))  # AWS_ENDPOINT_URL and its credentials set
    return f"s3://{new_bucket(endpoint)}/runs"


@benchmark()
def bench_poll(
    storage: Annotated[str | None, Opt("--storage", help="Where (s3://bucket/prefix, file://DIR); default a "
                                                          "temporary folder.")] = None,
    moto: Annotated[bool, Opt("--moto", help="Start moto's S3 server (the test suite's, in a "
                                             "process of its own) and use it (dev dependency).")] = False,
    learners: Annotated[int, Opt("--learners", min=1, help="Learners the deltas are spread over.")] = 3,
    deltas: Annotated[str, Opt("--deltas",
                               help="Comma-separated numbers of deltas in the run.")] = "1000,5000,10000",
    repeats: Annotated[int, Opt("--repeats", min=1,
                                help="Polls timed per row (the median is reported).")] = 5,
    versions: Annotated[str, Opt("--versions", help=(
        "Comma-separated numbers of versions in the chain, for the stop check's poll ('' for "
        "none)."))] = "1000,5000,10000",
) -> BenchResult:
    """What one merger poll and one stop check cost against the run's length: every key listed, or after the
    cursor / the version known."""
    counts = [int(x) for x in deltas.split(",") if x.strip()]
    version_counts = [int(x) for x in versions.split(",") if x.strip()]
    if not counts or min(counts) < learners or learners < 1 or repeats < 1:
        raise ConfigError(f"--deltas {deltas!r}: each count must be >= --learners ({learners}) >= 1, "
                         "--repeats >= 1")
    if version_counts and min(version_counts) < 2:
        raise ConfigError(f"--versions {versions!r}: each count must be >= 2")
    with ExitStack() as stack:
        if moto:
            storage = _moto_endpoint(stack)
        elif storage is None:
            storage = f"file://{stack.enter_context(tempfile.TemporaryDirectory(prefix='diloco-poll-'))}"
        store = open_store(storage)
        rows = [measure_row(store, learners, n, repeats) for n in counts]
        version_rows = [measure_versions(store, v, repeats) for v in version_counts]
    result = {"storage": storage.split("://")[0] + ("://moto" if moto else ""), "learners": learners,
              "rows": rows, "version_rows": version_rows}
    table = Table(f"one merger poll ({result['storage']}, {learners} learners, median of {repeats})",
                  ["deltas in the run", "every delta listed s", "after each cursor s", "keys listed (every)",
                   "keys listed (after)"])
    table.rows = [[f"{r['deltas']:,}", f"{r['full_listing_s']:.4f}", f"{r['after_cursor_s']:.4f}",
                   f"{r['keys_full']:,}", f"{r['keys_after_cursor']:,}"] for r in rows]
    tables = [table]
    if version_rows:
        table = Table(f"one poll of the newest version: a stop check ({result['storage']}, median of "
                      f"{repeats})",
                      ["versions in the chain", "every version listed s", "after the known one s",
                       "keys listed (every)", "keys listed (after)"])
        table.rows = [[f"{r['versions']:,}", f"{r['full_listing_s']:.4f}", f"{r['after_known_s']:.4f}",
                       f"{r['keys_full']:,}", f"{r['keys_after_known']:,}"] for r in version_rows]
        tables.append(table)
    return BenchResult(result, tables)

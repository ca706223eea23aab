"""Two mergers racing to commit the same version: exactly one wins, every round, and its manifest is intact.

Threads (each with its own ObjectStore) on memory://, file:// and S3; separate spawned processes on
file:// and S3, lined up by a barrier before every commit. The loser must see Conflict, never success.
Run: `.venv/bin/pytest tests/integration/test_commit_race.py` (add `-m "not s3"` to skip S3).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

import pytest

from diloco.storage import Conflict, Manifest, RunKeys, commit, latest_version, open_store, read_manifest

NUM_THREAD_ROUNDS = 30
NUM_PROCESS_ROUNDS = 30  # 10 rounds let a check-then-write fake pass on a fast disk; 30 do not
WRITERS = ("merger-a", "merger-b")
BARRIER_TIMEOUT_S = 60.0  # only a guard against a hung peer; never an assertion about speed


def _manifest(run_id: str, version: int, writer: str) -> Manifest:
    """What `writer` tries to commit as `version` (differs per writer, so a mix-up would show)."""
    keys = RunKeys(run_id)
    nonce = f"{WRITERS.index(writer):02d}{version:06d}"
    return Manifest(
        run_id=run_id,
        version=version,
        parent=version - 1,
        created_at=1000.0 + version,
        merger_id=writer,
        params_key=keys.params(version, nonce),
        params_checksum=f"{writer}-{version}" * 20,  # long enough that a torn write would not parse
        cursors={writer: version},
    )


def _try_commit(url: str, run_id: str, version: int, writer: str) -> str:
    try:
        commit(open_store(url), RunKeys(run_id), _manifest(run_id, version, writer))
    except Conflict:
        return "conflict"
    return "won"


def _check_rounds(url: str, run_id: str, outcomes: dict[int, dict[str, str]], num_rounds: int) -> None:
    store, keys = open_store(url), RunKeys(run_id)
    for version in range(num_rounds):
        by_writer = outcomes[version]
        winners = [w for w, outcome in by_writer.items() if outcome == "won"]
        assert sorted(by_writer.values()) == ["conflict", "won"], (version, by_writer)
        assert read_manifest(store, keys, version) == _manifest(run_id, version, winners[0])
    assert latest_version(store, keys) == num_rounds - 1


def test_threads_race_exactly_one_wins(store_url: str) -> None:
    run_id = "race-threads"
    barrier = threading.Barrier(len(WRITERS), timeout=BARRIER_TIMEOUT_S)
    outcomes: dict[int, dict[str, str]] = {v: {} for v in range(NUM_THREAD_ROUNDS)}
    errors: list[BaseException] = []

    def writer(name: str) -> None:
        store = open_store(store_url)  # each merger has its own store (and its own s3fs instance)
        try:
            for version in range(NUM_THREAD_ROUNDS):
                barrier.wait()
                try:
                    commit(store, RunKeys(run_id), _manifest(run_id, version, name))
                    outcomes[version][name] = "won"
                except Conflict:
                    outcomes[version][name] = "conflict"
        except BaseException as exc:  # surfaced below; a thread's exception would otherwise vanish
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=writer, args=(name,)) for name in WRITERS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    _check_rounds(store_url, run_id, outcomes, NUM_THREAD_ROUNDS)


def _process_writer(url: str, run_id: str, name: str, barrier: Any, results: Any) -> None:
    """Runs in a spawned child: NUM_PROCESS_ROUNDS lined-up commits, one result per round."""
    store = open_store(url)
    for version in range(NUM_PROCESS_ROUNDS):
        barrier.wait()
        try:
            commit(store, RunKeys(run_id), _manifest(run_id, version, name))
            results.put((version, name, "won"))
        except Conflict:
            results.put((version, name, "conflict"))


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def shared_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """A store URL that separate processes share: a folder on disk, or an S3 prefix."""
    if request.param == "s3":
        return request.getfixturevalue("s3_url")
    return f"file://{tmp_path}/bucket"


def test_processes_race_exactly_one_wins(shared_url: str) -> None:
    run_id = "race-procs"
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(WRITERS), timeout=BARRIER_TIMEOUT_S)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_process_writer, args=(shared_url, run_id, name, barrier, results))
        for name in WRITERS
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, dict[str, str]] = {v: {} for v in range(NUM_PROCESS_ROUNDS)}
    try:
        for _ in range(NUM_PROCESS_ROUNDS * len(WRITERS)):
            version, name, outcome = results.get(timeout=BARRIER_TIMEOUT_S * 2)
            outcomes[version][name] = outcome
    finally:
        for proc in procs:
            proc.join(timeout=BARRIER_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    _check_rounds(shared_url, run_id, outcomes, NUM_PROCESS_ROUNDS)


def test_a_loser_that_reloads_commits_the_next_version(store_url: str) -> None:
    """The optimistic loop the merger runs: on Conflict, reload latest and commit latest + 1."""
    run_id = "race-reload"
    assert _try_commit(store_url, run_id, 0, "merger-a") == "won"
    assert _try_commit(store_url, run_id, 0, "merger-b") == "conflict"
    next_version = latest_version(open_store(store_url), RunKeys(run_id)) + 1
    assert _try_commit(store_url, run_id, next_version, "merger-b") == "won"
    assert read_manifest(open_store(store_url), RunKeys(run_id), 1).merger_id == "merger-b"

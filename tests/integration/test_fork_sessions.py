"""A forked child that lets go of the S3 store it inherited: nothing of the parent's session is torn down in
the child — s3fs's finalizer closed it on the child's event loop ("Task exception was never retrieved ...
attached to a different loop", printed by `bench wan --links real`'s forked learners and evaluators) and
aiohttp's collection printed "Unclosed client session" and closed the connections the child shares with its
parent. The collection is run on the child's fsspec loop thread, where s3fs's finalizer schedules the close
(the case that printed); every exception the loop reports and everything the child prints is collected.
Run: .venv/bin/pytest tests/integration/test_fork_sessions.py -q
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import sys
import traceback
from pathlib import Path

import fsspec.asyn
import pytest

from diloco.storage import open_store

pytestmark = pytest.mark.s3
_INHERITED: list = []


async def _collect() -> None:
    gc.collect()


async def _nothing() -> None:
    return None


def _child(url: str, stderr: str, out) -> None:
    os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT), 2)  # what the child prints, for the test to read
    # Python's own prints there too (pytest's capture had replaced sys.stderr), for the child's life
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    try:
        out.put(_in_child(url))
    except BaseException:  # the test's own steps failed: the test says how
        out.put((None, [traceback.format_exc()]))
    sys.stderr.flush()
    out.close()
    out.join_thread()
    # ended here: what multiprocessing's exit would run next is the finalizers of whatever this worker
    # process held before the fork (other tests' leftovers under xdist), not what this test checks
    os._exit(0)


def _in_child(url: str) -> tuple[bytes, list[str]]:
    loop = fsspec.asyn.get_loop()  # the child's own fsspec loop (fsspec makes a new one after a fork)
    reported: list[str] = []
    loop.set_exception_handler(lambda _, context: reported.append(
        f"{context.get('message')}: {context.get('exception')!r}"))
    own = open_store(url)
    own.put("child", b"mine")  # the child's own store works
    if _INHERITED:
        held = [_INHERITED.pop() for _ in range(len(_INHERITED))]
        held.append(held)  # the inherited stores in a reference cycle: freed by a collection, not at once
        del held
    fsspec.asyn.sync(loop, _collect)  # the collection on the loop's thread, as when it ran there by chance
    fsspec.asyn.sync(loop, _nothing)  # a tick for a close the finalizer scheduled
    gc.collect()  # the finished task, were there one: its unretrieved exception is reported now
    fsspec.asyn.sync(loop, _nothing)
    return own.get("child"), reported


def _fork_and_check(s3_url: str, tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    stderr = tmp_path / "child.err"
    child = ctx.Process(target=_child, args=(s3_url, str(stderr), out))
    child.start()
    got, reported = out.get(timeout=60)
    child.join(30)
    assert child.exitcode == 0 and reported == [] and got == b"mine", reported
    printed = stderr.read_text()
    assert "Unclosed" not in printed and "Task exception" not in printed, printed


def test_a_forked_child_lets_go_of_its_inherited_s3_store_quietly(s3_url: str, tmp_path: Path) -> None:
    # held there only (the child's copy of this frame holds none); two stores with the same options, whose
    # s3fs instances are equal (fsspec compares their options), each with its own session
    _INHERITED.extend([open_store(s3_url), open_store(s3_url)])
    for store in _INHERITED:
        store.put("parent", b"ours")  # the session exists (s3fs makes it on first use)
    _fork_and_check(s3_url, tmp_path)
    assert [_INHERITED.pop().get("parent") for _ in range(2)] == [b"ours"] * 2  # the parent's are untouched


def test_a_forked_child_lets_go_of_a_store_its_parent_dropped_but_had_not_collected(
        s3_url: str, tmp_path: Path) -> None:
    """The store is gone, its s3fs instance waits in a reference cycle for a collection, which happens in the
    child (what failed under xdist: an earlier test's dropped store, collected by this file's child)."""
    gc.collect()
    gc.disable()  # the parent collects nothing until the child is forked
    try:
        dropped = open_store(s3_url)
        dropped.put("parent", b"ours")  # its session exists
        del dropped  # the backend is freed at once; its filesystem is left to the collector
        _fork_and_check(s3_url, tmp_path)
    finally:
        gc.enable()
    assert open_store(s3_url).get("parent") == b"ours"


def test_a_forked_child_lets_go_of_an_s3_corpus_its_parent_read_quietly(s3_url: str, tmp_path: Path) -> None:
    """A corpus on S3 is read through fsspec's own instance cache, not a store; a forked child clears that
    cache on its first filesystem (fsspec: a new process), which freed the parent's s3fs instance there."""
    from diloco.specs.text import read_documents

    open_store(s3_url).put("corpus/a.txt", b"to be, or not to be\n")
    docs, _ = read_documents(f"{s3_url}/corpus/a.txt")  # the corpus's filesystem has its session now
    assert docs
    _fork_and_check(s3_url, tmp_path)

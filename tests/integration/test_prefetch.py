"""learner.prefetch: a background thread fetches the newer global, the training thread installs it with no
request to the bucket, and holds the exact bits a learner fetching on the training thread holds; the
prefetcher follows installs made another way and rides out storage errors.
Run: `.venv/bin/pytest tests/integration/test_prefetch.py`.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from diloco.configs import load_config
from diloco.learner import prefetch
from diloco.learner.learner import Learner
from diloco.learner.prefetch import Prefetcher
from diloco.merger.merger import Merger
from diloco.run.chain_state import params_at
from diloco.run.create import create_run
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import TransientError, open_store
from diloco.storage.wrapper import WrapperStore


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config("tiny").data)


def _run(prefetch: bool, **learner):
    cfg = load_config("tiny").with_overrides({
        "run.num_learners": 2, "merger.quorum": 1, "merger.grace_cap_s": 0.0, "learner.prefetch": prefetch,
        "learner.prefetch_poll_s": 0.01, "learner.checkpoint": False, "learner.local_state_every_steps": 0,
        "learner.probe_every_steps": 1000, **{f"learner.{k}": v for k, v in learner.items()}})
    return create_run(open_store(f"memory://prefetch-{uuid.uuid4().hex[:10]}"), "pf", cfg)


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        if time.time() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def _two_versions(ctx, corpus) -> tuple[Learner, Learner]:
    a, b = (Learner(ctx, "local-0", make_spec(ctx.cfg, corpus)),
            Learner(ctx, "local-1", make_spec(ctx.cfg, corpus)))
    a.join(), b.join()
    if a.prefetcher is not None:  # the writer trains the same steps in both runs: no installs of its own
        a.prefetcher.close()
        a.prefetcher = None
    merger = Merger(ctx)
    merger.load()
    for _ in range(2):
        a.publish(a.run_phase())
        a.publisher.drain()
        merger.merge_once()
    return a, b


class Counting(WrapperStore):
    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.calls = 0

    def _over(self, inner):
        return self

    def get(self, key: str) -> bytes:
        self.calls += 1
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        self.calls += 1
        return self.inner.exists(key)


def test_prefetched_install_has_the_same_bits_and_needs_no_request(corpus) -> None:
    plain_a, plain_b = _two_versions(_run(False), corpus)
    ctx = _run(True)
    pre_a, pre_b = _two_versions(ctx, corpus)
    _wait_for(lambda: pre_b.prefetcher.fetches == 2)
    counting = Counting(pre_b.ctx.store)
    pre_b.ctx.store = pre_b.quick = counting
    assert pre_b.maybe_install() == 2 and counting.calls == 0
    assert plain_b.maybe_install() == 2
    for k, v in plain_b.theta().items():
        assert torch.equal(v, pre_b.theta()[k]), k
        assert torch.equal(plain_b.state.glob[k], pre_b.state.glob[k]), k
    assert pre_b.maybe_install() is None  # handed over once
    for learner in (plain_a, plain_b, pre_a, pre_b):
        learner.close()


def test_a_prefetched_global_is_installed_at_the_next_step_not_the_next_probe(corpus) -> None:
    """Taking what the prefetcher fetched costs no request, so a phase takes it at its first step (probes here
    are 1000 steps apart); a learner fetching on its training thread waits for its probe."""
    plain_a, plain_b = _two_versions(_run(False), corpus)
    pre_a, pre_b = _two_versions(_run(True), corpus)
    _wait_for(lambda: pre_b.prefetcher.fetches == 2)
    assert pre_b.run_phase(1).installs == [2] and pre_b.state.base == 2
    assert plain_b.run_phase(1).installs == [] and plain_b.state.base == 0
    for learner in (plain_a, plain_b, pre_a, pre_b):
        learner.close()


def test_rebase_follows_an_install_made_another_way(corpus) -> None:
    ctx = _run(False)
    a, b = _two_versions(ctx, corpus)
    fetcher = Prefetcher(ctx, ctx.store, "local-1", 0, b.state.glob, poll_s=30.0, max_updates_behind=4)
    b.install(2)
    fetcher.rebase(2, b.state.glob)
    assert fetcher.take() is None  # an older fetch (if it ran) is dropped; nothing newer than 2 exists
    fetcher.close()
    a.close(), b.close()


class Flaky(WrapperStore):
    def __init__(self, inner, failures: int) -> None:
        super().__init__(inner)
        self.failures = failures

    def _over(self, inner):
        return self

    def exists(self, key: str) -> bool:
        if self.failures > 0:
            self.failures -= 1
            raise TransientError("injected")
        return self.inner.exists(key)


def test_storage_errors_are_retried_on_the_next_poll(corpus) -> None:
    ctx = _run(False)
    a, b = _two_versions(ctx, corpus)
    fetcher = Prefetcher(ctx, Flaky(ctx.store, 3), "local-1", 0, b.state.glob, poll_s=0.01,
                         max_updates_behind=4)
    _wait_for(lambda: fetcher.fetches == 2)
    version, glob = fetcher.take()
    assert version == 2 and set(glob) == set(b.state.glob)
    fetcher.close()
    a.close(), b.close()


class Probes(WrapperStore):
    """Counts the probes (HEADs) and listings made through it, and records how many keys each listing returned
    (shared by its retrying views)."""

    def __init__(self, inner, counts: dict[str, int] | None = None, listed: list[int] | None = None) -> None:
        super().__init__(inner)
        self.counts = {"exists": 0, "list": 0} if counts is None else counts
        self.listed = [] if listed is None else listed

    def _over(self, inner):
        return Probes(inner, self.counts, self.listed)

    def exists(self, key: str) -> bool:
        self.counts["exists"] += 1
        return self.inner.exists(key)

    def list(self, prefix: str, after: str = "") -> list[str]:
        keys = self.inner.list(prefix, after)
        self.counts["list"] += 1
        self.listed.append(len(keys))
        return keys


def test_learners_list_only_the_versions_after_the_one_they_hold(corpus) -> None:
    """An install's probe and a prefetcher's poll list the chain from the version the learner holds (S3's
    StartAfter), never the whole chain: their cost follows what is new, not the run's age."""
    log: list[int] = []
    cfg = _run(False).cfg
    ctx = create_run(Probes(open_store(f"memory://listed-{uuid.uuid4().hex[:10]}"), listed=log), "pf", cfg)
    a, b = _two_versions(ctx, corpus)
    merger = Merger(ctx)
    merger.load()

    def merged(times: int) -> None:
        for _ in range(times):
            a.maybe_install()  # it sees its deltas merged (else it holds the next ones back)
            a.publish(a.run_phase())
            a.publisher.drain()
            merger.merge_once()

    assert b.maybe_install() == 2
    merged(3)
    log.clear()
    assert b.maybe_install() == 5
    assert log and max(log) <= 3, log  # versions 3..5; the whole chain is 6 versions
    merged(1)
    glob, _ = params_at(ctx, 5)
    log.clear()
    prefetcher = Prefetcher(ctx, ctx.store, "local-1", 5, glob, poll_s=60.0, max_updates_behind=8)
    try:
        _wait_for(lambda: prefetcher.fetches == 1)
    finally:
        prefetcher.close(timeout_s=1.0)
    assert log == [1], log  # version 6 alone


def test_an_expected_version_is_polled_for_at_once_and_idle_polls_are_slow(corpus, monkeypatch) -> None:
    """Prefetcher(idle_poll_s=...): it polls every idle_poll_s (here: never within the test) until expect() (a
    heads watcher saw its chain move): then at once and every poll_s until a newer version arrives, or
    EXPECT_POLLS polls passed. expect(v) fetches up to v with no probe or listing; a v that is not there falls
    back to the usual poll."""
    monkeypatch.setattr(prefetch, "EXPECT_POLLS", 10)
    ctx = _run(False)
    a, b = _two_versions(ctx, corpus)
    glob, _ = params_at(ctx, 2)
    counts = {"exists": 0, "list": 0}
    fetcher = Prefetcher(ctx, Probes(ctx.store, counts), "local-1", 2, glob, poll_s=0.02,
                         max_updates_behind=4, idle_poll_s=600.0)
    _wait_for(lambda: fetcher.polls == 1)
    fetcher.expect()  # nothing newer yet: 10 polls 0.02 s apart, then idle
    _wait_for(lambda: fetcher.polls >= 11)
    time.sleep(0.3)
    assert fetcher.polls <= 12 and fetcher.fetches == 0
    merger = Merger(ctx)
    merger.load()

    def merged() -> int:
        a.maybe_install()
        a.publish(a.run_phase())
        a.publisher.drain()
        return merger.merge_once().version

    assert merged() == 3
    time.sleep(0.3)
    assert fetcher.fetches == 0  # idle: not polled
    fetcher.expect(99)  # a version that is not there: the usual probe finds 3
    _wait_for(lambda: fetcher.fetches == 1)
    polls = fetcher.polls
    time.sleep(0.3)
    assert fetcher.polls == polls  # it arrived: idle again
    assert fetcher.take()[0] == 3
    assert merged() == 4
    counts.update(exists=0, list=0)
    fetcher.expect(4)
    _wait_for(lambda: fetcher.fetches == 2)
    assert counts == {"exists": 0, "list": 0}, counts  # straight to version 4's manifest and update
    version, fetched = fetcher.take()
    expected, _ = params_at(ctx, 4)
    assert version == 4 and all(torch.equal(fetched[k], expected[k]) for k in expected)
    fetcher.close()
    a.close(), b.close()

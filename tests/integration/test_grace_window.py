"""The merger's grace window: it waits up to its length for more deltas, and is over at once when every
learner that may publish has a delta pending (nobody is left to wait for).
Run: `.venv/bin/pytest tests/integration/test_grace_window.py`.
"""

from __future__ import annotations

import uuid

import pytest

from diloco.configs import load_config
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store

LONG_S = 30.0  # a window no test may wait out


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config("tiny").data)


def _setup(corpus, window_s: float):
    cfg = load_config("tiny").with_overrides({
        "run.num_learners": 2, "merger.quorum": 1, "merger.poll_interval_s": 0.02,
        "learner.checkpoint": False, "learner.local_state_every_steps": 0})
    ctx = create_run(open_store(f"memory://grace-{uuid.uuid4().hex[:10]}"), "grace", cfg)
    learners = [Learner(ctx, name, make_spec(ctx.cfg, corpus)) for name in ctx.learners]
    for learner in learners:
        learner.join()
    merger = Merger(ctx)
    merger.load()
    merger.grace_s = lambda: window_s  # the adaptive length needs a few phases of history; fixed here
    return learners, merger


def _publish(learner: Learner) -> None:
    learner.publish(learner.run_phase(2))
    learner.publisher.drain()


def test_the_window_is_over_once_every_learner_has_a_delta_pending(corpus) -> None:
    learners, merger = _setup(corpus, LONG_S)
    for learner in learners:
        _publish(learner)
    manifest = merger.merge_once()
    assert (manifest is not None
            and sorted(d.learner for d in manifest.merged()) == sorted(lr.name for lr in learners))
    assert manifest.timing["grace_s"] < LONG_S / 2  # it did not wait the window out
    for learner in learners:
        learner.close()


def test_the_window_waits_its_length_for_a_learner_still_to_come(corpus) -> None:
    learners, merger = _setup(corpus, 0.3)
    _publish(learners[0])
    manifest = merger.merge_once()
    assert manifest is not None and [d.learner for d in manifest.merged()] == [learners[0].name]
    assert manifest.timing["grace_s"] >= 0.3
    for learner in learners:
        learner.close()

"""inner.schedule_clock and data.sampling: with "run", a learner's lr schedule moves at each install to the
run's clock (tokens merged / (learners x its tokens per step)) and advances one per own step from there, on
the training thread's fetch, the prefetcher's and a fragment's; "own" (the default) keeps the own step count.
`data.sampling: whole` draws each learner's windows from the whole text, its own random stream.
Run: `.venv/bin/pytest tests/integration/test_schedule_clock.py`.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from diloco.configs import load_config
from diloco.learner.learner import Learner
from diloco.merger.loop import ShardMerger
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store
from diloco.training.data import ShardSampler
from diloco.training.inner import lr_at

H = 8


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config("tiny").data)


def _ctx(**overrides):
    cfg = load_config("tiny").with_overrides({
        "run.num_learners": 2, "merger.quorum": 1, "merger.grace_cap_s": 0.0, "learner.checkpoint": False,
        "learner.local_state_every_steps": 0, "learner.probe_every_steps": 1000, "inner.steps_per_phase": H,
        "inner.warmup_steps": 4, "inner.total_steps": 64, **overrides})
    return create_run(open_store(f"memory://clock-{uuid.uuid4().hex[:10]}"), "clock", cfg)


def _one_version(ctx, corpus) -> tuple[Learner, Learner, int]:
    """b trains 3 steps; then learner a ships one phase of H steps, merged as version 1. Returns the tokens
    per step."""
    a, b = (Learner(ctx, name, make_spec(ctx.cfg, corpus)) for name in ("local-0", "local-1"))
    a.join(), b.join()
    b.run_phase(3)
    merger = Merger(ctx)
    merger.load()
    a.publish(a.run_phase())
    a.publisher.drain()
    assert merger.merge_once().tokens_total == H * a.trainer.last_tokens
    return a, b, a.trainer.last_tokens


def test_run_clock_moves_the_schedule_at_install(corpus):
    ctx = _ctx(**{"inner.schedule_clock": "run"})
    a, b, _ = _one_version(ctx, corpus)
    assert b.trainer.schedule_step == 3  # no install yet: its own steps
    b.install(1)
    # 8 steps x tps merged by 2 learners: the run is at step 4; b (3 own steps) jumps one ahead
    assert b.trainer.step == 3 and b.trainer.schedule_step == H // 2
    assert b.trainer.lr == pytest.approx(lr_at(H // 2, ctx.cfg.inner))
    b.run_phase(5)
    assert b.trainer.step == 8 and b.trainer.schedule_step == H // 2 + 5
    for learner in (a, b):
        learner.close()
    # a learner joining version 1 (no checkpoint: step 0) takes the run's clock at its first step
    c = Learner(ctx, "local-1", make_spec(ctx.cfg, corpus))
    assert c.join() == 1 and c.trainer.schedule_step == 0
    c.run_phase(3)
    assert c.trainer.step == 3 and c.trainer.schedule_step == H // 2 + 3
    c.close()


def test_own_clock_is_the_step_count(corpus):
    ctx = _ctx()
    assert ctx.cfg.inner.schedule_clock == "own"
    a, b, _ = _one_version(ctx, corpus)
    b.install(1)
    assert b.trainer.schedule_step == b.trainer.step == 3 and b.trainer.clock_offset == 0
    for learner in (a, b):
        learner.close()


def test_run_clock_through_the_prefetcher(corpus):
    ctx = _ctx(**{"inner.schedule_clock": "run", "learner.prefetch": True, "learner.prefetch_poll_s": 0.01})
    a, b, _ = _one_version(ctx, corpus)
    deadline = time.time() + 10
    while b.maybe_install() is None:  # the prefetcher hands version 1 over
        assert time.time() < deadline, "the prefetcher never fetched version 1"
        time.sleep(0.01)
    assert b.state.base == 1 and b.trainer.schedule_step == H // 2
    for learner in (a, b):
        learner.close()


def test_run_clock_on_a_fragment_install(corpus):
    ctx = _ctx(**{"inner.schedule_clock": "run", "fragments.count": 2})
    a, b = (Learner(ctx, name, make_spec(ctx.cfg, corpus)) for name in ("local-0", "local-1"))
    a.join(), b.join()
    a.publisher.full = lambda *_: False  # a due ship waits for room (slow storage would defer it)
    a.run_phase()  # fragment 0 ships at step 0 of the stagger, fragment 1 at H/2: both shipped within H steps
    a.drain()
    assert ShardMerger(ctx, 0).poll_once()
    b.run_phase(3)
    assert b.maybe_install() == [0, 1]
    # each chain merged the steps its delta carried: fragment 0 all 8 (shipped at step H), fragment 1 the
    # first 4 (shipped at H/2); the last install (fragment 1) sets the clock: 4 steps / 2 learners
    assert b.trainer.step == 3 and b.trainer.schedule_step == H // 4
    for learner in (a, b):
        learner.close()


def test_whole_text_sampling_draws_everywhere_with_a_stream_per_learner():
    data = (np.arange(40_000) % 251).astype(np.uint8)
    starts = {}
    for whole in (False, True):
        for shard in (0, 1):
            sampler = ShardSampler(data, shard, 4, 8, 16, seed=7, whole=whole)
            batches = [sampler.next_batch()[0] for _ in range(50)]
            starts[whole, shard] = batches
    # a shard's windows stay in its quarter of the text; the whole text's reach past it
    assert len(ShardSampler(data, 0, 4, 8, 16, seed=7).data) == 10_000
    assert len(ShardSampler(data, 0, 4, 8, 16, seed=7, whole=True).data) == 40_000
    assert not all((a == b).all() for a, b in zip(starts[True, 0], starts[True, 1], strict=True))
    # the stream is a pure function of (seed, shard, i): resuming at a cursor gives the same batch
    resumed = ShardSampler(data, 1, 4, 8, 16, seed=7, cursor=10, whole=True)
    assert (resumed.next_batch()[0] == starts[True, 1][10]).all()


def test_the_gpt_spec_follows_data_sampling(corpus):
    for sampling, expected in (("shard", len(corpus.train) // 2), ("whole", len(corpus.train))):
        ctx = _ctx(**{"data.sampling": sampling})
        spec = make_spec(ctx.cfg, corpus)
        x, _ = next(iter(spec.batches(1, 2, 0)))
        assert x.shape[0] == ctx.cfg.data.batch_size
        sampler = ShardSampler(corpus.train, 1, 2, 1, ctx.cfg.model.ctx_len, 0, whole=sampling == "whole")
        assert abs(len(sampler.data) - expected) <= 1


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="schedule_clock"):
        load_config("tiny").with_overrides({"inner.schedule_clock": "wall"})
    with pytest.raises(ValueError, match="sampling"):
        load_config("tiny").with_overrides({"data.sampling": "everything"})

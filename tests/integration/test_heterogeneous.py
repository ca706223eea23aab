"""Learners of different speeds: the fast never wait for the slow one, and each contributes by
its own weight (tokens^2/steps, discounted by staleness).
Run: .venv/bin/pytest tests/integration/test_heterogeneous.py -q
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from diloco.configs import load_config
from diloco.learner.learner import Learner
from diloco.learner.loop import run_learner
from diloco.merger.loop import ShardMerger, run_merger
from diloco.run.create import create_run
from diloco.run.fragments import manifests
from diloco.run.signals import StopSignal, request_stop
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store, read_latest

pytestmark = pytest.mark.slow


def test_fast_learners_never_wait_and_everyone_counts():
    cfg = load_config("tiny").with_overrides({
        "run.num_learners": 3, "run.num_versions": 14, "merger.quorum": 1, "merger.grace_cap_s": 0.0,
        "inner.steps_per_phase": 5, "outer.max_staleness": 50,
        # one H for all: the slow learner's phases take 6x the wall time (DyLU: test_dylu.py)
        "inner.dylu": False,
    })
    ctx = create_run(open_store(f"memory://hetero-{uuid.uuid4().hex[:10]}"), "hetero", cfg)
    corpus = load_corpus(cfg.data)
    slow_name = ctx.learners[2]
    learners = [Learner(ctx, name, make_spec(ctx.cfg, corpus), slowdown=6.0 if name == slow_name else 1.0)
                for name in ctx.learners]
    phases: dict[str, list] = {lr.name: [] for lr in learners}
    threads = [threading.Thread(target=run_learner, args=(lr,), daemon=True,
                                kwargs={"should_stop": StopSignal(ctx, None, every_s=0.1),
                                        "on_phase": phases[lr.name].append})
               for lr in learners]
    merger = ShardMerger(ctx)
    deadline = time.time() + 90

    def enough() -> bool:
        """The target version, and the slow learner's first delta decided (however fast the others are);
        at the deadline the assertions below say what is missing."""
        latest = read_latest(ctx.store, ctx.keys)
        return time.time() > deadline or (latest is not None and latest.version >= cfg.run.num_versions
                                           and latest.cursors.get(slow_name, -1) >= 0)

    for t in threads:
        t.start()
    run_merger(merger, should_stop=enough)
    request_stop(ctx, "test done")
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()

    fast = [n for n in ctx.learners if n != slow_name]
    for name in fast:  # the fast ones ran many phases and never stalled on anyone
        assert len(phases[name]) >= 2 * max(1, len(phases[slow_name])), {n: len(p) for n, p in phases.items()}
        assert sum(s.stall_s for s in phases[name]) < 1.0
    merged = [d for m in manifests(ctx) for d in m.merged()]
    tokens = {n: sum(d.tokens for d in merged if d.learner == n) for n in ctx.learners}
    assert tokens[slow_name] > 0, "the slow learner's work never reached the global model"
    assert all(tokens[n] > tokens[slow_name] for n in fast)
    for m in manifests(ctx):  # within one merge, weight follows tokens^2/steps x discount
        group = {d.learner: d for d in m.merged()}
        if slow_name in group and len(group) > 1:
            s = group[slow_name]
            for name, d in group.items():
                if name != slow_name and d.tokens == s.tokens and d.staleness < s.staleness:
                    assert d.weight > s.weight

"""Ship-and-carry under random interleavings of train, publish, merge and install (property-based).

Invariant (DESIGN §5): shipped + carried = all local progress — nothing lost, nothing counted
twice — whatever the order of events and whatever the (lossy) delta codec.
Run: .venv/bin/pytest tests/integration/test_ship_and_carry.py -q
"""

from __future__ import annotations

import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.configs import load_config
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store
from diloco.training.model import get_flat_params

OPS = st.lists(st.sampled_from(["train", "publish", "merge", "install"]), min_size=4, max_size=24)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config("tiny").data)


class ProgressMeter:
    """Wraps a learner's train step to add up the local optimizer's own parameter changes."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        self.total = {k: torch.zeros_like(v) for k, v in learner.theta().items()}
        original = learner.trainer.train_step

        def counted(*batch):
            before = get_flat_params(learner.model)
            loss = original(*batch)
            after = get_flat_params(learner.model)
            for k in self.total:
                self.total[k] += after[k] - before[k]
            return loss

        learner.trainer.train_step = counted


def _once():
    state = {"n": 0}

    def stop():
        state["n"] += 1
        return state["n"] > 1  # one poll of the bucket, never a wait

    return stop


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, codec=st.sampled_from(["fp32", "int8", "int4"]))
def test_shipped_plus_carried_is_all_progress(corpus, ops, codec):
    cfg = load_config("tiny").with_overrides({
        "run.num_learners": 1, "merger.quorum": 1, "merger.grace_cap_s": 0.0, "learner.codec": codec,
        "outer.lr": 1.0, "outer.momentum": 0.0, "outer.update_codec": "fp32", "inner.steps_per_phase": 2,
        "learner.probe_every_steps": 1000, "outer.max_staleness": 1000,
    })
    ctx = create_run(open_store(f"memory://carry-{uuid.uuid4().hex[:10]}"), "carry", cfg)
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    learner.join()
    theta0 = learner.theta()
    meter = ProgressMeter(learner)
    merger = Merger(ctx)
    merger.load()
    shipped = {k: torch.zeros_like(v) for k, v in theta0.items()}
    for op in [*ops, "publish", "merge", "install"]:  # end with everything shipped, merged, installed
        if op == "train":
            learner.run_phase()
        elif op == "publish":
            before = {k: v.clone() for k, v in learner.state.ref.items()}
            learner.publish()
            learner.publisher.drain()
            for k in shipped:  # progress shipped = what left the reference
                shipped[k] += before[k] - learner.state.ref[k]
        elif op == "merge":
            merger.merge_once(_once())
        else:
            learner.maybe_install()
        carried = {k: learner.theta()[k] - learner.state.ref[k] for k in shipped}
        for k in shipped:  # shipped (as progress) + carried == all local progress
            assert torch.allclose(-shipped[k] + carried[k], meter.total[k], atol=1e-5), op
    # one learner, outer lr 1, no momentum: the global is exactly the start plus what was shipped
    for k in theta0:
        assert torch.allclose(merger.params[k], theta0[k] - shipped[k], atol=1e-5)
        assert torch.allclose(learner.theta()[k], theta0[k] + meter.total[k], atol=1e-5)
    learner.close()


def test_a_phase_ends_at_its_next_probe_once_the_run_has_ended(corpus):
    """run_learner gives the learner its stop signal (stop_check): after the run's end a phase trains only to
    its next probe, not to its H, and what it trained is still shipped (steps and tokens in the delta)."""
    cfg = load_config("tiny").with_overrides({"run.num_learners": 1, "inner.steps_per_phase": 20,
                                              "learner.probe_every_steps": 5})
    ctx = create_run(open_store(f"memory://stop-{uuid.uuid4().hex[:10]}"), "stop", cfg)
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    learner.join()
    full = learner.run_phase()
    assert full.steps == 20
    polls = []
    # ends at the 2nd probe
    learner.stop_check = lambda: polls.append(learner.trainer.step) or len(polls) >= 2
    cut = learner.run_phase()
    assert cut.steps == 10 and polls == [25, 30] and learner.trainer.step == 30
    assert learner.state.steps_since_publish == 30 and cut.tokens == full.tokens // 2
    learner.close()

"""Oracles: the system against simple reference code written here.

1. quorum = all learners, lossless codec, sync mode (zero staleness) == synchronous DiLoCo, round by round;
2. one learner, H = 1, outer lr 1, momentum 0 == plain AdamW, step by step.
Run: .venv/bin/pytest tests/integration/test_oracles.py -q
"""

from __future__ import annotations

import uuid

import torch

from diloco.configs import load_config
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store
from diloco.training.data import ShardSampler, shard_of
from diloco.training.inner import InnerTrainer
from diloco.training.model import build_model, get_flat_params, set_params

# The only difference from the reference is fp32 rounding of G - (G - theta) in the carry (about
# one ulp per round), which AdamW's normalisation then carries along; each round moves the
# parameters by over 100x this tolerance (asserted), so a real divergence cannot hide under it.
ATOL = 1e-4


def _system(cfg):
    store = open_store(f"memory://oracle-{uuid.uuid4().hex[:10]}")
    ctx = create_run(store, "oracle", cfg)
    corpus = load_corpus(cfg.data)
    learners = [Learner(ctx, name, make_spec(ctx.cfg, corpus)) for name in ctx.learners]
    for learner in learners:
        learner.join()
    merger = Merger(ctx)
    merger.load()
    return ctx, corpus, learners, merger


def _sync_round(learners, merger):
    """Every learner runs a phase and publishes; one merge takes all; everyone installs it."""
    seqs = []
    for learner in learners:
        learner.run_phase()
        seqs.append(learner.publish())
        learner.publisher.drain()
    manifest = merger.merge_once()
    assert manifest is not None and len(manifest.merged()) == len(learners)
    for learner, seq in zip(learners, seqs, strict=True):
        assert learner.wait_for_decision(seq, timeout_s=5) == manifest.version
    return manifest


def _close(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_sync_diloco_oracle():
    cfg = load_config("tiny").with_overrides({
        "run.num_learners": 2, "merger.quorum": 2, "merger.grace_cap_s": 0.0, "learner.mode": "sync",
        "learner.codec": "fp32", "outer.update_codec": "fp32", "outer.merge_rule": "mean",
        "learner.probe_every_steps": 1000, "outer.lr": 0.7, "outer.momentum": 0.9,
    })
    ctx, corpus, learners, merger = _system(cfg)

    # --- reference synchronous DiLoCo, written out plainly ---
    global_params = get_flat_params(build_model(cfg.model, seed=cfg.data.seed))
    workers, samplers, trainers = [], [], []
    for name in ctx.learners:
        model = build_model(cfg.model, seed=cfg.data.seed)
        workers.append(model)
        trainers.append(InnerTrainer(model, cfg.inner))
        shard, n = shard_of(name, ctx.learners)
        samplers.append(ShardSampler(corpus.train, shard, n, cfg.data.batch_size, cfg.model.ctx_len,
                                     cfg.data.seed))
    momentum = {k: torch.zeros_like(v) for k, v in global_params.items()}
    lr, mu = cfg.outer.lr, cfg.outer.momentum
    previous = {k: v.clone() for k, v in global_params.items()}

    for _ in range(4):
        manifest = _sync_round(learners, merger)
        deltas = []
        for model, trainer, sampler in zip(workers, trainers, samplers, strict=True):
            for _ in range(cfg.inner.steps_per_phase):
                x, y = sampler.next_batch()
                trainer.train_step(x, y)
            theta = get_flat_params(model)
            deltas.append({k: global_params[k] - theta[k] for k in theta})
        for k in global_params:
            g = sum(d[k] for d in deltas) / len(deltas)
            momentum[k] = mu * momentum[k] + g
            global_params[k] = global_params[k] - lr * (g + mu * momentum[k])
        moved = _close(previous, global_params)
        assert moved > 100 * ATOL, moved
        previous = {k: v.clone() for k, v in global_params.items()}
        for model in workers:
            set_params(model, global_params)
        assert manifest.version == merger.version
        assert _close(merger.params, global_params) < ATOL
        for learner in learners:
            assert _close(learner.theta(), global_params) < ATOL
            assert all(d.staleness == 0 for d in manifest.merged())


def test_single_learner_equals_plain_adamw():
    cfg = load_config("tiny").with_overrides({
        "run.num_learners": 1, "merger.quorum": 1, "merger.grace_cap_s": 0.0, "learner.mode": "sync",
        "learner.codec": "fp32", "outer.update_codec": "fp32", "outer.lr": 1.0, "outer.momentum": 0.0,
        "inner.steps_per_phase": 1, "learner.probe_every_steps": 1000,
    })
    ctx, corpus, learners, merger = _system(cfg)
    model = build_model(cfg.model, seed=cfg.data.seed)
    trainer = InnerTrainer(model, cfg.inner)
    shard, n = shard_of(ctx.learners[0], ctx.learners)
    sampler = ShardSampler(corpus.train, shard, n, cfg.data.batch_size, cfg.model.ctx_len, cfg.data.seed)
    for step in range(12):
        _sync_round(learners, merger)
        x, y = sampler.next_batch()
        trainer.train_step(x, y)
        reference = get_flat_params(model)
        assert _close(learners[0].theta(), reference) < ATOL / 5, f"diverged at step {step}"
        assert _close(merger.params, reference) < ATOL / 5
    assert merger.version == 12

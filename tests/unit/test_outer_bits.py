"""The outer step's committed bits are those of the code before `OuterOptimizer` (issue #12): a private
copy of the old arithmetic (`_old_outer_step`, tokens-based round share, lr applied twice on a backlog)
is the reference. Merges of at most one round must match it bit for bit (update bytes, params, outer
state, weights, norm, share) over random deltas, several chained merges, shares < 1 and = 1, both merge
rules, Nesterov on and off, momentum per merge and per round, lossless and quantized updates. A backlog
(rounds > 1) now applies lr once, p - lr*(g + mu*buf'), equal to the old p - lr*(rate + mu*buf') -
lr*(g - rate) in exact arithmetic: within fp32 rounding (the momentum still bit for bit).
Run: .venv/bin/pytest tests/unit/test_outer_bits.py -q
"""

from __future__ import annotations

import itertools

import pytest
import torch

from diloco.configs import load_config
from diloco.merger.step import LearnerGroup, OuterState, gradient_stream, outer_optimizer, outer_step
from diloco.run.objects import decode_tensors, encode_tensors
from diloco.training.merge import Combiner, delta_weight
from diloco.training.model import EMBEDDING_PARAMS
from diloco.training.tensors import add_, clone

M = 3  # learners in the run
# momentum on
BASE = load_config("tiny").with_overrides({"run.num_learners": M, "outer.lr": 0.7, "outer.momentum": 0.9})
H, B, CTX = BASE.inner.steps_per_phase, BASE.data.batch_size, BASE.model.ctx_len
SHAPES = {"wte.weight": (16, 8), "wpe.weight": (4, 8), "h.0.attn.weight": (8, 8), "ln_f.bias": (8,)}


# ---- the reference: the outer step as it was before OuterOptimizer (copied, not imported) --------
def _old_nesterov_step(params, grad, momentum_buf, lr, momentum, nesterov=True, share=1.0):
    decay = momentum if share == 1.0 else momentum ** share
    new_params, new_buf = {}, {}
    for name, p in params.items():
        p32, g = p.detach().float(), grad[name].detach().float()
        old = None if momentum_buf is None else momentum_buf[name].detach().float()
        buf = g.clone() if old is None else old.mul(decay).add(g)
        step = g.add(buf, alpha=momentum * share) if nesterov else buf
        new_params[name] = p32.add(step, alpha=-lr)
        new_buf[name] = buf
    return new_params, new_buf


def _old_outer_step(params, outer, groups, version, cfg, num_learners, fingerprint):
    """The former GradientStream (weights, tokens-based rounds, finish) + outer_step, verbatim in
    arithmetic."""
    combiner = Combiner(cfg.outer.merge_rule, direct=tuple(k for k in params if k in EMBEDDING_PARAMS))
    weights, tokens = {}, 0
    for learner, g_tokens, g_steps, min_base, total in groups:
        weights[learner] = delta_weight(g_tokens, g_steps, max(0, version - min_base),
                                        cfg.outer.staleness_power)
        tokens += g_tokens
        combiner.add(total, weights[learner])
    per_phase = cfg.inner.steps_per_phase * cfg.data.batch_size * cfg.model.ctx_len
    rounds = tokens / (max(1, num_learners) * per_phase) if cfg.outer.partial_scaling else 1.0
    total_w = sum(weights.values())
    normalised = {k: (w / total_w if total_w > 0 else 0.0) for k, w in weights.items()}
    scale = min(1.0, rounds)
    grad = None
    if weights and total_w > 0:
        grad = combiner.result()
        if scale != 1.0:
            grad = {k: v * scale for k, v in grad.items()}
    if grad is not None:
        spread = rounds > 1.0 and cfg.experimental.backlog_momentum == "round_rate"
        rate = {k: v / rounds for k, v in grad.items()} if spread else grad
        share = min(1.0, rounds) if cfg.experimental.momentum_per == "round" and rounds > 0 else 1.0
        new_params, momentum = _old_nesterov_step(params, rate, outer.momentum, cfg.outer.lr,
                                                  cfg.outer.momentum, cfg.outer.nesterov, share=share)
        if rate is not grad:
            for k in new_params:
                new_params[k] -= cfg.outer.lr * (grad[k] - rate[k])
        exact = {k: (new_params[k] - params[k]) + outer.residual[k] for k in params}
    else:
        momentum = outer.momentum
        exact = {k: outer.residual[k].clone() for k in params}
    update_bytes = encode_tensors(exact, codec_name=cfg.outer.update_codec, kind="update",
                                    fingerprint=fingerprint, meta={"version": version + 1})
    _, shipped = decode_tensors(update_bytes)
    residual = {k: exact[k] - shipped[k] for k in params}
    new_global = clone(params)
    add_(new_global, shipped)
    norm = float(torch.sqrt(sum((v.double() ** 2).sum() for v in shipped.values())))
    return update_bytes, new_global, OuterState(momentum, residual), normalised, norm, scale


# ---- driving both ---------------------------------------------------------------------------------
def _groups(gen, version: int, spec: list[tuple[str, int, int]]):
    """spec: (learner, phases' steps, staleness) -> (learner, tokens, steps, min_base, random delta)."""
    return [(name, steps * B * CTX, steps, max(0, version - stale),
             {k: torch.randn(s, generator=gen) * 0.05 for k, s in SHAPES.items()})
            for name, steps, stale in spec]


def _new_outer_step(params, outer, groups, version, cfg, fingerprint):
    stream = gradient_stream(params, version, cfg.outer)
    for name, tokens, steps, min_base, total in groups:
        stream.add(LearnerGroup(name, seqs=[0], tokens=tokens, steps=steps, min_base=min_base,
                                total={k: v.clone() for k, v in total.items()}))
    return outer_step(params, outer, stream, fingerprint, outer_optimizer(cfg, M))


# merges of at most one round: share 1/3, 2/3, 1, a learner's two deltas summed + one (= 1), a partial
# phase (7 steps), a stale delta, an all-rejected (no-op) merge, and the full round again
ROUND_OR_LESS = [
    [("local-0", H, 0)],
    [("local-1", H, 0), ("local-2", H, 1)],
    [("local-0", H, 0), ("local-1", H, 0), ("local-2", H, 0)],
    [("local-0", 2 * H, 2), ("local-2", H, 0)],
    [("local-1", 7, 0)],
    [],
    [("local-0", H, 3), ("local-1", H // 2, 1)],
    [("local-0", H, 0), ("local-1", H, 0), ("local-2", H, 0)],
]


def _chain(cfg, merges, seed=0):
    """Yield (old result, new result) merge after merge, each side carrying its own state."""
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    old_p, old_o = params, OuterState.zeros_like(params)
    new_p, new_o = {k: v.clone() for k, v in params.items()}, OuterState.zeros_like(params)
    for version, spec in enumerate(merges):
        groups = _groups(gen, version, spec)
        old = _old_outer_step(old_p, old_o, groups, version, cfg, M, "fp")
        new = _new_outer_step(new_p, new_o, groups, version, cfg, "fp")
        yield old, new
        old_p, old_o = old[1], old[2]
        new_p, new_o = new.params, new.outer


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


CASES = list(itertools.product(("mean", "rda"), (True, False), ("merge", "round"), ("fp32", "int8", "int4")))


@pytest.mark.parametrize("rule,nesterov,per,codec", CASES)
def test_a_round_or_less_commits_the_old_bits(rule, nesterov, per, codec):
    cfg = BASE.with_overrides({"outer.merge_rule": rule, "outer.nesterov": nesterov,
                               "experimental.momentum_per": per, "outer.update_codec": codec})
    shares = []
    for old, new in _chain(cfg, ROUND_OR_LESS):
        update_bytes, params, outer, weights, norm, scale = old
        assert new.update_bytes == update_bytes
        assert _same(new.params, params)
        assert _same(new.outer.momentum, outer.momentum) and _same(new.outer.residual, outer.residual)
        assert _same(new.outer.to_tensors(), outer.to_tensors())  # the .outer object's names and bits
        assert new.weights == weights and new.update_norm == norm and new.scale == scale
        shares.append(scale)
    assert shares[:3] == [1 / 3, 2 / 3, 1.0] and 0.0 in shares and shares[4] == 7 / (M * H)


@pytest.mark.parametrize("rule", ["mean", "rda"])
def test_without_partial_scaling_every_merge_is_a_whole_step_with_the_old_bits(rule):
    cfg = BASE.with_overrides({"outer.merge_rule": rule, "outer.partial_scaling": False,
                               "outer.update_codec": "int8"})
    for old, new in _chain(cfg, ROUND_OR_LESS, seed=1):
        assert new.update_bytes == old[0] and _same(new.params, old[1]) and new.scale == old[5]
        assert _same(new.outer.to_tensors(), old[2].to_tensors())


def test_the_round_share_in_steps_is_the_old_share_in_tokens():
    """tokens = steps x B x T for the built-in GPT: tokens/(M*H*B*T) and steps/(M*H) are one float."""
    optimizer = outer_optimizer(BASE, M)
    for steps in range(1, 4 * M * H):
        assert optimizer.rounds(steps) == (steps * B * CTX) / (M * H * B * CTX)


BACKLOG = [[("local-0", H, 0)], [("local-0", 3 * H, 0), ("local-1", 2 * H, 1)],
           [("local-1", H, 0), ("local-2", 6 * H, 0)], [("local-0", H, 0)]]


@pytest.mark.parametrize("nesterov,per", [(True, "merge"), (False, "merge"), (True, "round")])
def test_a_backlog_applies_lr_once_equal_to_the_old_two_steps_within_fp32(nesterov, per):
    cfg = BASE.with_overrides({"outer.nesterov": nesterov, "experimental.momentum_per": per})
    before = None
    for old, new in _chain(cfg, BACKLOG, seed=2):
        assert _same(new.outer.momentum, old[2].momentum)  # buf' = mu*buf + g/rounds, as before: same bits
        for k in SHAPES:
            assert torch.allclose(new.params[k], old[1][k], rtol=1e-6, atol=1e-6)
        if before is not None:  # each merge moves the params by far more than the tolerance
            assert min(float((new.params[k] - before[k]).abs().max()) for k in SHAPES) > 1e-3
        assert new.weights == old[3] and new.scale == old[5]
        before = new.params
    assert [old[5] for old, _ in _chain(cfg, BACKLOG, seed=2)] == [1 / 3, 1.0, 1.0, 1 / 3]


def test_a_backlog_taken_whole_commits_the_old_bits():
    cfg = BASE.with_overrides({"experimental.backlog_momentum": "whole", "outer.update_codec": "int8"})
    for old, new in _chain(cfg, BACKLOG, seed=3):
        assert new.update_bytes == old[0] and _same(new.params, old[1])
        assert _same(new.outer.to_tensors(), old[2].to_tensors())


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_whole_round_is_torch_sgd(nesterov):
    """share 1, lossless: the exact update is torch.optim.SGD's step and the buffer its momentum_buffer."""
    cfg = BASE.with_overrides({"outer.nesterov": nesterov})
    optimizer = outer_optimizer(cfg, M)
    gen = torch.Generator().manual_seed(4)
    ref = {k: torch.nn.Parameter(torch.randn(s, generator=gen)) for k, s in SHAPES.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=nesterov)
    state = OuterState.zeros_like({k: p.detach() for k, p in ref.items()})
    for _ in range(4):
        grad = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
        before = {k: p.detach().clone() for k, p in ref.items()}
        update = optimizer.update(before, state, grad, merged_steps=M * H)
        for k, p in ref.items():
            p.grad = grad[k].clone()
        sgd.step()
        assert update.share == 1.0
        assert all(torch.equal(update.exact[k], ref[k].detach() - before[k]) for k in ref)
        assert all(torch.equal(update.momentum[k], sgd.state[ref[k]]["momentum_buffer"]) for k in ref)
        state = optimizer.state_after(update, update.exact)
        assert all(not v.any() for v in state.residual.values())

"""The outer step on a backlog: a merge carrying several rounds of tokens (the merger or the storage
was down) applies all of the progress, but feeds the momentum buffer one round's rate, so Nesterov
does not re-apply the backlog on every later merge; a round or less is the plain (partial) step.
Run: .venv/bin/pytest tests/unit/test_outer_backlog.py -q
"""

from __future__ import annotations

import pytest
import torch

from diloco.configs import load_config
from diloco.merger.step import LearnerGroup, OuterState, gradient_stream, outer_optimizer, outer_step

CFG = load_config("tiny").with_overrides({"run.num_learners": 2, "outer.update_codec": "fp32",
                                          "outer.lr": 0.7, "outer.momentum": 0.9})
PHASE_TOKENS = CFG.inner.steps_per_phase * CFG.data.batch_size * CFG.model.ctx_len
LR, MU = CFG.outer.lr, CFG.outer.momentum


def step(delta: torch.Tensor, phases: int, outer: OuterState) -> tuple[dict, OuterState, float]:
    params = {"w": torch.zeros(4)}
    stream = gradient_stream(params, version=0, outer=CFG.outer)
    stream.add(LearnerGroup("local-0", seqs=list(range(phases)), tokens=phases * PHASE_TOKENS,
                            steps=phases * CFG.inner.steps_per_phase, min_base=0, total={"w": delta.clone()}))
    optimizer = outer_optimizer(CFG, num_learners=2)
    result = outer_step(params, outer, stream, "fp", optimizer)
    return result.params, result.outer, optimizer.rounds(stream.steps)


@pytest.mark.parametrize("phases", [6, 20])
def test_backlog_moves_by_all_of_it_and_feeds_momentum_one_round(phases):
    delta = torch.tensor([1.0, -2.0, 0.5, 4.0])
    params, outer, rounds = step(delta, phases, OuterState.zeros_like({"w": torch.zeros(4)}))
    assert rounds == phases / 2 > 1
    rate = delta / rounds
    assert torch.allclose(outer.momentum["w"], rate)
    assert torch.allclose(params["w"], -LR * (delta + MU * rate), atol=1e-6)
    # the ring after it: the next merges re-apply MU**k of one round's rate, not of the whole backlog
    plain_params, plain_outer, _ = step(delta, 2, OuterState.zeros_like({"w": torch.zeros(4)}))
    assert outer.momentum["w"].abs().sum() < plain_outer.momentum["w"].abs().sum()


def test_a_round_or_less_is_the_plain_partial_nesterov_step():
    delta = torch.tensor([1.0, -2.0, 0.5, 4.0])
    for phases, share in ((1, 0.5), (2, 1.0)):
        params, outer, rounds = step(delta, phases, OuterState.zeros_like({"w": torch.zeros(4)}))
        assert rounds == share
        assert torch.allclose(outer.momentum["w"], share * delta)
        assert torch.allclose(params["w"], -LR * (1 + MU) * share * delta, atol=1e-6)


def test_momentum_per_round_makes_a_round_of_partial_merges_one_outer_step():
    """`experimental.momentum_per: round`: a merge carrying share s decays the buffer by mu**s and looks ahead
    by s*mu*buf. Two half-round merges of the same pseudo-gradient then move the params like one whole
    round does under the per-merge rule at steady state, where per merge they overshoot."""
    cfg = CFG.with_overrides({"experimental.momentum_per": "round"})
    delta = torch.tensor([1.0, -2.0, 0.5, 4.0])
    buf0 = torch.tensor([0.5, 0.5, -1.0, 2.0])

    def half(outer: OuterState, config) -> tuple[torch.Tensor, OuterState]:
        params = {"w": torch.zeros(4)}
        stream = gradient_stream(params, version=0, outer=config.outer)
        stream.add(LearnerGroup("local-0", seqs=[0], tokens=PHASE_TOKENS, steps=CFG.inner.steps_per_phase,
                                min_base=0, total={"w": delta.clone()}))
        result = outer_step(params, outer, stream, "fp", outer_optimizer(config, num_learners=2))
        return result.params["w"], result.outer

    step1, outer1 = half(OuterState({"w": buf0.clone()}, {"w": torch.zeros(4)}), cfg)
    g = 0.5 * delta  # the half-round share of the pseudo-gradient
    buf1 = MU ** 0.5 * buf0 + g
    assert torch.allclose(outer1.momentum["w"], buf1)
    assert torch.allclose(step1, -LR * (g + 0.5 * MU * buf1), atol=1e-6)
    step2, outer2 = half(outer1, cfg)
    buf2 = MU ** 0.5 * buf1 + g
    assert torch.allclose(outer2.momentum["w"], buf2, atol=1e-6)
    # after a whole round the buffer has decayed by mu, as one synchronous round would
    assert torch.allclose(buf2, MU * buf0 + (1 + MU ** 0.5) * g, atol=1e-6)
    # per merge: each half-round merge decays by mu and looks ahead by mu*buf, about twice the round's
    per_merge1, m1 = half(OuterState({"w": buf0.clone()}, {"w": torch.zeros(4)}), CFG)
    assert torch.allclose(m1.momentum["w"], MU * buf0 + g)
    assert torch.allclose(per_merge1, -LR * (g + MU * (MU * buf0 + g)), atol=1e-6)


def test_nesterov_share_is_checked():
    from diloco.training.outer import nesterov_step

    with pytest.raises(ValueError, match="share"):
        nesterov_step({"w": torch.zeros(2)}, {"w": torch.ones(2)}, None, lr=1.0, momentum=0.9, share=0.0)

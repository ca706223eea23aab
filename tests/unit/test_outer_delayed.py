"""`experimental.momentum_per: delayed` (delayed Nesterov): partial-round merges are applied plainly and kept
pending; the merge that completes a round feeds the buffer the round's sum and adds one look-ahead, so a
round of partial merges is one Nesterov step of the round's gradient; the pending state round-trips through
the stored outer object, and the other rules store exactly what they always did.
Run: .venv/bin/pytest tests/unit/test_outer_delayed.py -q
"""

from __future__ import annotations

import torch

from diloco.configs import load_config
from diloco.training.outer import OuterOptimizer, OuterState, nesterov_step

CFG = load_config("tiny").with_overrides({"experimental.momentum_per": "delayed",
                                          "outer.update_codec": "fp32",
                                          "outer.lr": 0.7, "outer.momentum": 0.9})
H, M = CFG.inner.steps_per_phase, 2
LR, MU = CFG.outer.lr, CFG.outer.momentum


def _opt(cfg=CFG) -> OuterOptimizer:
    return OuterOptimizer(cfg.outer, cfg.experimental, H * M)


def _apply(params, state, g, steps, opt):
    up = opt.update(params, state, g, steps)
    new = {k: params[k] + up.exact[k] for k in params}
    return new, opt.state_after(up, up.exact)


def test_a_round_of_half_merges_is_one_nesterov_step() -> None:
    params = {"w": torch.zeros(3)}
    buf0 = {"w": torch.tensor([0.5, -1.0, 2.0])}
    g1, g2 = {"w": torch.tensor([1.0, 2.0, -1.0])}, {"w": torch.tensor([3.0, 0.0, 1.0])}
    state = OuterState(dict(buf0), {"w": torch.zeros(3)})
    p1, s1 = _apply(params, state, g1, H, _opt())  # half a round: plain
    assert torch.allclose(p1["w"], -LR * 0.5 * g1["w"])
    assert torch.equal(s1.momentum["w"], buf0["w"]) and s1.pending_share == 0.5
    p2, s2 = _apply(p1, s1, g2, H, _opt())  # completes the round
    round_g = {"w": 0.5 * (g1["w"] + g2["w"])}
    want, want_buf = nesterov_step(params, round_g, dict(buf0), LR, MU)
    assert torch.allclose(p2["w"], want["w"], atol=1e-6) and torch.allclose(s2.momentum["w"], want_buf["w"])
    assert s2.pending == {} and s2.pending_share == 0.0


def test_full_rounds_are_the_plain_nesterov_step_bit_for_bit() -> None:
    params = {"w": torch.tensor([0.1, 0.2, 0.3])}
    state = OuterState({"w": torch.tensor([1.0, 2.0, 3.0])}, {"w": torch.zeros(3)})
    g = {"w": torch.tensor([0.7, -0.3, 0.9])}
    delayed = _opt().update(params, state, g, H * M)
    merge = _opt(CFG.with_overrides({"experimental.momentum_per": "merge"})).update(params, state, g, H * M)
    assert (torch.equal(delayed.exact["w"], merge.exact["w"])
            and torch.equal(delayed.momentum["w"], merge.momentum["w"]))


def test_pending_round_trips_and_other_rules_store_no_pending() -> None:
    params = {"w": torch.zeros(3)}
    _, s1 = _apply(params, OuterState.zeros_like(params), {"w": torch.ones(3)}, H, _opt())
    stored = s1.to_tensors()
    assert "pending/w" in stored and "pending_share" in stored
    back = OuterState.from_tensors(stored, params)
    assert back.pending_share == 0.5 and torch.equal(back.pending["w"], s1.pending["w"])
    assert set(OuterState.zeros_like(params).to_tensors()) == {"momentum/w", "residual/w"}
    no_op = _opt().update(params, s1, None, 0)  # every delta rejected: the pending part waits
    assert no_op.pending_share == 0.5

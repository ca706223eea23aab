"""The outer optimizer: Nesterov SGD on the merged pseudo-gradient, with the partial-round share, the
backlog rule, momentum per merge or per round, and the residual (error feedback) of the quantized update.

Contract: functional — (params, OuterState, pseudo-gradient, merged steps) in, a fresh update and state
out, inputs never modified; fp32; `outer.lr` is applied in one place (`nesterov_step`); it reads only its
own config sections and `steps_per_round`; the state lives in the bucket, never only in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.configs import ExperimentalConfig, OuterConfig

Tensors = dict[str, torch.Tensor]


def _check_same(params: Tensors, other: Tensors, what: str) -> None:
    if set(other) != set(params):
        missing, extra = sorted(set(params) - set(other)), sorted(set(other) - set(params))
        raise ValueError(f"{what}: tensor names differ from the params: missing {missing}, unexpected "
                         f"{extra}")
    for name, p in params.items():
        if tuple(other[name].shape) != tuple(p.shape):
            raise ValueError(f"{what}[{name}]: shape {tuple(other[name].shape)} != {tuple(p.shape)}")


def nesterov_step(
    params: Tensors,
    grad: Tensors,
    momentum_buf: Tensors | None,
    lr: float,
    momentum: float,
    nesterov: bool = True,
    share: float = 1.0,
    buffer_grad: Tensors | None = None,
) -> tuple[Tensors, Tensors]:
    """buf = mu*buf + g; step = g + mu*buf (nesterov) or buf; params - lr*step. None buf = zeros.

    share = 1: bit-identical to torch.optim.SGD(lr, momentum, nesterov, dampening=0) fed `grad`.
    share s in (0, 1) is a fractional step, a merge that carries a share s of a round: the buffer
    decays by mu**s and the Nesterov look-ahead is s*mu*buf, so 1/s such steps of g*s add up to
    about one whole step of g (momentum's memory is counted in rounds, not merges).
    buffer_grad (default: grad) is what the buffer takes, `buf = mu*buf + buffer_grad`, while the
    step still applies all of grad: `g + mu*buf` (nesterov) or `buf + (g - buffer_grad)`.
    Inputs are not modified; outputs are fresh fp32 tensors in the params' name order. ValueError
    on a name or shape mismatch.
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share}")
    decay = momentum if share == 1.0 else momentum ** share
    _check_same(params, grad, "grad")
    for other, what in ((momentum_buf, "momentum_buf"), (buffer_grad, "buffer_grad")):
        if other is not None:
            _check_same(params, other, what)
    new_params: Tensors = {}
    new_buf: Tensors = {}
    for name, p in params.items():
        p32, g = p.detach().float(), grad[name].detach().float()
        g_buf = g if buffer_grad is None else buffer_grad[name].detach().float()
        # SGD's first step sets buf = g, which is exactly mu * 0 + g
        old = None if momentum_buf is None else momentum_buf[name].detach().float()
        buf = g_buf.clone() if old is None else old.mul(decay).add(g_buf)
        # not nesterov: SGD momentum's step, buf, plus the part of a backlog the buffer did not take
        step = g.add(buf, alpha=momentum * share) if nesterov else (buf if g_buf is g else buf.add(g - g_buf))
        new_params[name] = p32.add(step, alpha=-lr)  # the one place the outer lr is applied
        new_buf[name] = buf
    return new_params, new_buf


@dataclass
class OuterState:
    """The outer optimizer's state: the momentum buffer and the update's quantization residual; under
    `experimental.momentum_per: delayed` also the partial-round gradients applied plainly since the last
    momentum step (`pending`) and the round share they add up to (empty / 0 otherwise)."""

    momentum: Tensors
    residual: Tensors
    pending: Tensors = field(default_factory=dict)
    pending_share: float = 0.0

    @classmethod
    def zeros_like(cls, params: Tensors) -> OuterState:
        return cls({k: torch.zeros_like(v) for k, v in params.items()},
                   {k: torch.zeros_like(v) for k, v in params.items()})

    def to_tensors(self) -> Tensors:
        """Flat name -> tensor: "momentum/<param>" and "residual/<param>" (the stored .outer object)."""
        out = {f"momentum/{k}": v for k, v in self.momentum.items()}
        out.update({f"residual/{k}": v for k, v in self.residual.items()})
        if self.pending:  # only delayed momentum has it: other rules store exactly what they always did
            out.update({f"pending/{k}": v for k, v in self.pending.items()})
            out["pending_share"] = torch.tensor([self.pending_share], dtype=torch.float64)
        return out

    @classmethod
    def from_tensors(cls, tensors: Tensors, params: Tensors) -> OuterState:
        """The inverse of to_tensors; ValueError naming the first tensor missing for one of `params`."""
        try:
            pending = {k: tensors[f"pending/{k}"] for k in params} if "pending_share" in tensors else {}
            share = float(tensors["pending_share"].reshape(-1)[0]) if pending else 0.0
            return cls({k: tensors[f"momentum/{k}"] for k in params},
                       {k: tensors[f"residual/{k}"] for k in params}, pending, share)
        except KeyError as err:
            raise ValueError(f"outer state lacks tensor {err}") from None


@dataclass
class OuterUpdate:
    """One outer step before it is shipped: the exact update (step + residual), the new momentum."""

    exact: Tensors
    momentum: Tensors
    share: float  # the round share the step carried (1.0 without partial scaling)
    pending: Tensors = field(default_factory=dict)  # delayed momentum: applied plainly, not in the buffer yet
    pending_share: float = 0.0


class OuterOptimizer:
    """The outer step of one merge. `steps_per_round` = inner.steps_per_phase x number of learners.

    A merge carrying `rounds = merged steps / steps_per_round` of a round (1.0 without
    `outer.partial_scaling`) scales the pseudo-gradient by share = min(1, rounds). A backlog
    (rounds > 1) is applied whole, while momentum takes it at one round's rate (grad / rounds) under
    `experimental.backlog_momentum: round_rate`. `experimental.momentum_per: round` makes a merge
    a fractional Nesterov step of its share (nesterov_step). The caller quantizes `exact`, ships it
    and hands the shipped tensors back to `residual_after` (error feedback: residual' = exact - shipped).
    """

    def __init__(self, cfg: OuterConfig, experimental: ExperimentalConfig, steps_per_round: int) -> None:
        if steps_per_round < 1:
            raise ValueError(f"steps_per_round must be >= 1, got {steps_per_round}")
        self.cfg, self.experimental, self.steps_per_round = cfg, experimental, steps_per_round

    @property
    def update_codec(self) -> str:
        return self.cfg.update_codec

    def rounds(self, merged_steps: int) -> float:
        """Steps merged / steps of a full round (every learner one phase); 1.0 without partial scaling."""
        # Steps, not tokens, so the engine does not depend on tokens per step. For the built-in GPT
        # tokens = steps x batch x ctx exactly, so the former tokens / (M*H*B*T) and steps / (M*H) are
        # the same rational, and Python's int / int is correctly rounded: the same float, the same bits.
        if not self.cfg.partial_scaling:
            return 1.0
        return merged_steps / self.steps_per_round

    def round_share(self, merged_steps: int) -> float:
        """rounds(), capped at 1: the scale of a partial merge's pseudo-gradient."""
        return min(1.0, self.rounds(merged_steps))

    def update(self, params: Tensors, state: OuterState, grad: Tensors | None,
               merged_steps: int) -> OuterUpdate:
        """The exact update for the combined pseudo-gradient `grad` (None: every delta was rejected, a
        no-op version that ships the residual and keeps the momentum)."""
        share = self.round_share(merged_steps)
        if grad is None:
            return OuterUpdate({k: state.residual[k].clone() for k in params}, state.momentum, share,
                               state.pending, state.pending_share)
        rounds = self.rounds(merged_steps)
        if share != 1.0:
            grad = {k: v * share for k, v in grad.items()}
        if self.experimental.momentum_per == "delayed":
            return self._delayed(params, state, grad, share, rounds)
        # A backlog (the merger or the storage was down): several rounds of progress in one merge. The step
        # applies all of it, but the momentum buffer takes it at one round's rate (grad / rounds), so momentum
        # does not re-apply the whole backlog on every following merge (which spiked the loss after outages).
        spread = rounds > 1.0 and self.experimental.backlog_momentum == "round_rate"
        buffer_grad = {k: v / rounds for k, v in grad.items()} if spread else None
        fraction = share if self.experimental.momentum_per == "round" and rounds > 0 else 1.0
        new_params, momentum = nesterov_step(params, grad, state.momentum, self.cfg.lr, self.cfg.momentum,
                                             self.cfg.nesterov, share=fraction, buffer_grad=buffer_grad)
        exact = {k: (new_params[k] - params[k]) + state.residual[k] for k in params}
        return OuterUpdate(exact, momentum, share)

    def _delayed(self, params: Tensors, state: OuterState, grad: Tensors, share: float,
                 rounds: float) -> OuterUpdate:
        """Delayed Nesterov (Asynchronous Local-SGD): a partial-round merge is applied plainly (lr * g) and
        kept pending; once the pending shares add up to a round, the buffer takes them all (buf = mu*buf +
        sum) and that merge adds the look-ahead: a round of partial merges moves the global by exactly one
        Nesterov step of the round's gradient. A merge of a round or more is a plain Nesterov step (its
        buffer taking (pending + g) / rounds under backlog_momentum: round_rate)."""
        total = grad if not state.pending else {k: state.pending[k] + grad[k] for k in grad}
        total_share = state.pending_share + share
        if total_share < 1.0 - 1e-9:  # not a round yet: plain SGD, the buffer waits
            new_params = {k: params[k].detach().float().add(grad[k].float(), alpha=-self.cfg.lr)
                          for k in params}
            exact = {k: (new_params[k] - params[k]) + state.residual[k] for k in params}
            return OuterUpdate(exact, state.momentum, share, total, total_share)
        spread = rounds > 1.0 and self.experimental.backlog_momentum == "round_rate"
        buffer_grad = {k: v / rounds for k, v in total.items()} if spread else total
        new_params, momentum = nesterov_step(params, grad, state.momentum, self.cfg.lr, self.cfg.momentum,
                                             self.cfg.nesterov, buffer_grad=buffer_grad)
        exact = {k: (new_params[k] - params[k]) + state.residual[k] for k in params}
        return OuterUpdate(exact, momentum, share, {}, 0.0)

    def residual_after(self, exact: Tensors, shipped: Tensors) -> Tensors:
        """Error feedback: what quantization left out of `exact`, added to the next merge's update."""
        return {k: exact[k] - shipped[k] for k in exact}

    def state_after(self, update: OuterUpdate, shipped: Tensors) -> OuterState:
        """The state after `update` was shipped as `shipped` (its decoded tensors)."""
        return OuterState(update.momentum, self.residual_after(update.exact, shipped), update.pending,
                          update.pending_share)

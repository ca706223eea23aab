"""The outer optimizer: SGD with Nesterov momentum on the merged pseudo-gradient.

Contract: functional — (params, grad, momentum) in, (new params, new momentum) out; fp32; the
state lives in the bucket, never only in memory.
"""

from __future__ import annotations

import torch


def _check_same(params: dict[str, torch.Tensor], other: dict[str, torch.Tensor], what: str) -> None:
    if set(other) != set(params):
        missing, extra = sorted(set(params) - set(other)), sorted(set(other) - set(params))
        raise ValueError(f"{what}: tensor names differ from the params: missing {missing}, unexpected {extra}")
    for name, p in params.items():
        if tuple(other[name].shape) != tuple(p.shape):
            raise ValueError(f"{what}[{name}]: shape {tuple(other[name].shape)} != {tuple(p.shape)}")


def nesterov_step(
    params: dict[str, torch.Tensor],
    grad: dict[str, torch.Tensor],
    momentum_buf: dict[str, torch.Tensor] | None,
    lr: float,
    momentum: float,
    nesterov: bool = True,
    share: float = 1.0,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """buf = mu*buf + g; step = g + mu*buf (nesterov) or buf; params - lr*step. None buf = zeros.

    share = 1: bit-identical to torch.optim.SGD(lr, momentum, nesterov, dampening=0) fed `grad`.
    share s in (0, 1) is a fractional step, a merge that carries a share s of a round: the buffer
    decays by mu**s and the Nesterov look-ahead is s*mu*buf, so 1/s such steps of g*s add up to
    about one whole step of g (momentum's memory is counted in rounds, not merges). Inputs are
    not modified; outputs are fresh fp32 tensors in the params' name order. ValueError on a
    name or shape mismatch.
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share}")
    decay = momentum if share == 1.0 else momentum ** share
    _check_same(params, grad, "grad")
    if momentum_buf is not None:
        _check_same(params, momentum_buf, "momentum_buf")
    new_params: dict[str, torch.Tensor] = {}
    new_buf: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        p32, g = p.detach().float(), grad[name].detach().float()
        # SGD's first step sets buf = g, which is exactly mu * 0 + g
        old = None if momentum_buf is None else momentum_buf[name].detach().float()
        buf = g.clone() if old is None else old.mul(decay).add(g)
        step = g.add(buf, alpha=momentum * share) if nesterov else buf
        new_params[name] = p32.add(step, alpha=-lr)
        new_buf[name] = buf
    return new_params, new_buf

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
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """buf = mu*buf + g; step = g + mu*buf (nesterov) or buf; params - lr*step. None buf = zeros.

    Bit-identical to torch.optim.SGD(lr, momentum, nesterov, dampening=0) fed `grad`. Inputs are
    not modified; outputs are fresh fp32 tensors in the params' name order. ValueError on a
    name or shape mismatch.
    """
    _check_same(params, grad, "grad")
    if momentum_buf is not None:
        _check_same(params, momentum_buf, "momentum_buf")
    new_params: dict[str, torch.Tensor] = {}
    new_buf: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        p32, g = p.detach().float(), grad[name].detach().float()
        # SGD's first step sets buf = g, which is exactly mu * 0 + g
        old = None if momentum_buf is None else momentum_buf[name].detach().float()
        buf = g.clone() if old is None else old.mul(momentum).add(g)
        step = g.add(buf, alpha=momentum) if nesterov else buf
        new_params[name] = p32.add(step, alpha=-lr)
        new_buf[name] = buf
    return new_params, new_buf

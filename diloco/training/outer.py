"""The outer optimizer: SGD with Nesterov momentum on the merged pseudo-gradient.

Contract: functional — (params, grad, momentum) in, (new params, new momentum) out; fp32; the
state lives in the bucket, never only in memory.
"""
# STUB — to be implemented.

from __future__ import annotations

import torch


def nesterov_step(
    params: dict[str, torch.Tensor],
    grad: dict[str, torch.Tensor],
    momentum_buf: dict[str, torch.Tensor] | None,
    lr: float,
    momentum: float,
    nesterov: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """buf = mu*buf + g; step = g + mu*buf (nesterov) or buf; params - lr*step. None buf = zeros."""
    raise NotImplementedError

"""Tensor dicts (parameter name -> tensor): the pure operations the learner, the merger and audit share.

Contract: no I/O; functions return new dicts except the in-place `add_`; numpy <-> torch gives fp32
CPU, contiguous arrays.
"""

from __future__ import annotations

import numpy as np
import torch

Tensors = dict[str, torch.Tensor]


def to_numpy(tensors: Tensors) -> dict[str, np.ndarray]:
    return {k: v.detach().to("cpu", torch.float32).contiguous().numpy() for k, v in tensors.items()}


def to_torch(arrays: dict[str, np.ndarray]) -> Tensors:
    # asarray(order="C"), not ascontiguousarray: that one turns a 0-d array (a scalar parameter) into shape
    # (1,)
    return {k: torch.from_numpy(np.asarray(v, dtype=np.float32, order="C")) for k, v in arrays.items()}


def add_(target: Tensors, other: Tensors, alpha: float = 1.0) -> None:
    for k, v in target.items():
        v.add_(other[k], alpha=alpha)


def sub(a: Tensors, b: Tensors) -> Tensors:
    return {k: a[k] - b[k] for k in a}


def clone(t: Tensors) -> Tensors:
    return {k: v.detach().clone() for k, v in t.items()}


def all_finite(t: Tensors) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in t.values())


def same_layout(a: Tensors, b: Tensors) -> bool:
    return list(a) == list(b) and all(a[k].shape == b[k].shape for k in a)

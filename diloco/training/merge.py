"""Merge rules: delta weights (tokens^2/steps x staleness discount), weighted mean and RDA.

Contract: streaming — memory holds one accumulator, not one buffer per learner; the result
depends only on the inputs and their order (deterministic).
"""
# STUB — to be implemented.

from __future__ import annotations

import torch


def delta_weight(tokens: int, steps: int, staleness: int, staleness_power: float) -> float:
    """tokens * (tokens / steps) * (1 + staleness) ** -staleness_power; 0 for empty deltas."""
    raise NotImplementedError


class Combiner:
    """Accumulate weighted deltas one learner at a time, then produce the combined pseudo-gradient.

    rule "mean": sum(w * d) / sum(w).  rule "rda" (radial-directional averaging, per tensor):
    (sum(w*|d|)/sum(w)) * unit(sum(w * unit(d)) / sum(w)); tensors named in `direct` (the
    embedding) use the mean.
    """

    def __init__(self, rule: str, direct: tuple[str, ...] = ()) -> None:
        raise NotImplementedError

    def add(self, delta: dict[str, torch.Tensor], weight: float) -> None:
        raise NotImplementedError

    def result(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

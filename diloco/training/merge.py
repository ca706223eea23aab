"""Merge rules: delta weights (tokens^2/steps x staleness discount), weighted mean and RDA.

Contract: streaming — memory holds one accumulator, not one buffer per learner; the result
depends only on the inputs and their order (deterministic).
"""

from __future__ import annotations

import math

import torch

MERGE_RULES = ("mean", "rda")
ACC_DTYPE = torch.float64  # accumulate in fp64, hand back fp32


def delta_weight(tokens: int, steps: int, staleness: int, staleness_power: float) -> float:
    """tokens * (tokens / steps) * (1 + staleness) ** -staleness_power; 0 for empty deltas."""
    if tokens < 0 or steps < 0 or staleness < 0 or staleness_power < 0:
        raise ValueError(f"delta_weight needs tokens, steps, staleness, staleness_power >= 0; got "
                         f"{tokens}, {steps}, {staleness}, {staleness_power}")
    if tokens == 0 or steps == 0:
        return 0.0
    return float(tokens * (tokens / steps) * (1 + staleness) ** -staleness_power)


def _unit(x: torch.Tensor) -> torch.Tensor:
    norm = torch.linalg.vector_norm(x)
    return torch.zeros_like(x) if norm == 0 else x / norm


class Combiner:
    """Accumulate weighted deltas one learner at a time, then produce the combined pseudo-gradient.

    rule "mean": sum(w * d) / sum(w).  rule "rda" (radial-directional averaging, per tensor):
    (sum(w*|d|)/sum(w)) * unit(sum(w * unit(d)) / sum(w)); tensors named in `direct` (the
    embedding) use the mean. ValueError (nothing changed) for a bad weight or a delta whose
    names/shapes differ from the first one; result() with no deltas or zero total weight.
    """

    def __init__(self, rule: str, direct: tuple[str, ...] = ()) -> None:
        if rule not in MERGE_RULES:
            raise ValueError(f"merge rule {rule!r} must be one of {MERGE_RULES}")
        self.rule = rule
        self.direct = frozenset(direct)
        self.num_added = 0
        self.total_weight = 0.0
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._acc: dict[str, torch.Tensor] = {}  # mean: sum w*d; rda: sum w*unit(d)
        self._norm_acc: dict[str, float] = {}  # rda only: sum w*|d|

    def _uses_rda(self, name: str) -> bool:
        return self.rule == "rda" and name not in self.direct

    def _validate(self, delta: dict[str, torch.Tensor], weight: float) -> None:
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"delta weight must be finite and >= 0, got {weight}")
        if not delta:
            raise ValueError("a delta needs at least one tensor")
        if self._shapes is None:
            return
        if set(delta) != set(self._shapes):
            missing, extra = sorted(set(self._shapes) - set(delta)), sorted(set(delta) - set(self._shapes))
            raise ValueError(f"delta tensor names differ: missing {missing}, unexpected {extra}")
        for name, shape in self._shapes.items():
            if tuple(delta[name].shape) != shape:
                raise ValueError(f"delta[{name}]: shape {tuple(delta[name].shape)} != {shape}")

    def add(self, delta: dict[str, torch.Tensor], weight: float) -> None:
        """Fold one delta (name -> tensor) with its weight into the accumulators."""
        weight = float(weight)
        self._validate(delta, weight)
        if self._shapes is None:
            self._shapes = {name: tuple(t.shape) for name, t in delta.items()}
            self._acc = {name: torch.zeros(shape, dtype=ACC_DTYPE) for name, shape in self._shapes.items()}
            self._norm_acc = {name: 0.0 for name in self._shapes if self._uses_rda(name)}
        for name in self._shapes:
            d = delta[name].detach().to("cpu", ACC_DTYPE)
            if self._uses_rda(name):
                self._norm_acc[name] += weight * float(torch.linalg.vector_norm(d))
                d = _unit(d)
            self._acc[name].add_(d, alpha=weight)
        self.num_added += 1
        self.total_weight += weight

    def result(self) -> dict[str, torch.Tensor]:
        """The combined pseudo-gradient: name -> fp32 CPU tensor, in the first delta's order."""
        if self._shapes is None:
            raise ValueError("no deltas to combine")
        if self.total_weight <= 0:
            raise ValueError(f"total weight of the {self.num_added} delta(s) is zero")
        out: dict[str, torch.Tensor] = {}
        for name, acc in self._acc.items():
            mean = acc / self.total_weight
            if self._uses_rda(name):
                mean = _unit(mean) * (self._norm_acc[name] / self.total_weight)
            out[name] = mean.to(torch.float32)
        return out

"""Merge rules: delta weights (tokens^2/steps x staleness discount), weighted mean and RDA.

Contract: streaming — memory holds one accumulator, not one buffer per learner; the result
depends only on the inputs and their order (deterministic).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from diloco.training.fp64 import Arena, Fp64Scratch, add_scaled_, quotient_fp32

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
    names/shapes differ from the first one; result() with no deltas or zero total weight. `arena`: the
    accumulators are its views (zeroed: the same bits as fresh zeros), valid until its next combination.
    """

    def __init__(self, rule: str, direct: tuple[str, ...] = (), arena: Arena | None = None) -> None:
        if rule not in MERGE_RULES:
            raise ValueError(f"merge rule {rule!r} must be one of {MERGE_RULES}")
        self.rule = rule
        self.direct = frozenset(direct)
        self.arena = arena
        self.num_added = 0
        self.total_weight = 0.0
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._acc: dict[str, torch.Tensor] = {}  # mean: sum w*d; rda: sum w*unit(d)
        self._norm_acc: dict[str, float] = {}  # rda only: sum w*|d|
        self._scratch = Fp64Scratch()  # one chunk of a delta in fp64 (the mean's elementwise fold)

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

    def add(self, delta: dict[str, torch.Tensor], weight: float, consume: bool = False,
            on_folded: Callable[[int], None] | None = None,
            recycle: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """Fold one delta (name -> tensor) with its weight into the accumulators; `consume`: each tensor is
        taken out of `delta` once folded (the same bits; the caller's dict is emptied) and handed to
        `recycle(name, tensor)` when given (nobody else may hold it: its memory is reused); `on_folded(i)`
        after the i-th tensor is."""
        weight = float(weight)
        self._validate(delta, weight)
        if self._shapes is None:
            self._shapes = {name: tuple(t.shape) for name, t in delta.items()}
            self._acc = self.arena.views(self._shapes, zero=True) if self.arena is not None else \
                {name: torch.zeros(shape, dtype=ACC_DTYPE) for name, shape in self._shapes.items()}
            self._norm_acc = {name: 0.0 for name in self._shapes if self._uses_rda(name)}
        for index, name in enumerate(self._shapes):
            value = delta.pop(name) if consume else delta[name]
            if not self._uses_rda(name):  # acc += w * fp64(d), chunk by chunk: the same bits, no fp64 copy
                add_scaled_(self._acc[name], value.detach(), weight, self._scratch)
            else:
                d = value.detach().to("cpu", ACC_DTYPE)
                self._norm_acc[name] += weight * float(torch.linalg.vector_norm(d))
                self._acc[name].add_(_unit(d), alpha=weight)
                del d
            if consume and recycle is not None:
                recycle(name, value)
            del value  # consumed: freed here (or recycled)
            if on_folded is not None:
                on_folded(index)
        self.num_added += 1
        self.total_weight += weight

    def result(self) -> dict[str, torch.Tensor]:
        """The combined pseudo-gradient: name -> fp32 CPU tensor, in the first delta's order."""
        return self._result(consume=False)

    def take_result(self, into: Callable[[str], torch.Tensor | None] | None = None,
                    ) -> dict[str, torch.Tensor]:
        """result(), consuming the accumulators tensor by tensor (the same bits; the combiner is empty
        after it): the fp64 sums and the fp32 result are never both held whole. `into(name)`: an fp32 buffer
        nobody else holds that a mean tensor's result is written to, when it has that tensor's shape (e.g. a
        folded delta's, given back), or None."""
        return self._result(consume=True, into=into)

    def _result(self, consume: bool, into: Callable[[str], torch.Tensor | None] | None = None,
                ) -> dict[str, torch.Tensor]:
        if self._shapes is None:
            raise ValueError("no deltas to combine")
        if self.total_weight <= 0:
            raise ValueError(f"total weight of the {self.num_added} delta(s) is zero")
        out: dict[str, torch.Tensor] = {}
        for name in list(self._acc):
            acc = self._acc.pop(name) if consume else self._acc[name]
            if self._uses_rda(name):
                # the same division either way
                mean = acc.div_(self.total_weight) if consume else acc / self.total_weight
                mean = _unit(mean) * (self._norm_acc[name] / self.total_weight)
                out[name] = mean.to(torch.float32)
                del mean
            else:  # (acc / total).to(fp32), a chunk at a time in cache: the same bits
                buffer = None if into is None else into(name)
                if buffer is not None and (buffer.shape != acc.shape or buffer.dtype != torch.float32
                                           or not buffer.is_contiguous()):
                    buffer = None
                out[name] = quotient_fp32(acc, self.total_weight, self._scratch, out=buffer)
            del acc
        if consume:  # as new: the next add() starts a fresh combination
            self._shapes, self._norm_acc, self.num_added, self.total_weight = None, {}, 0, 0.0
            self._scratch.release()
        return out

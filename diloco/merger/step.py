"""The deterministic core of one merge: the judged deltas (diloco.trust.judge) -> fold them (GradientStream)
-> the outer optimizer -> quantize the update (`outer.update_codec`) -> new global. Shared by the merger and
`audit`.

Contract: outer_step is a pure function of (params, outer state, the merged deltas in decision order,
the optimizer); replaying it on the stored objects reproduces the committed bits. The buffers a delta carries
after its parameters (header meta `buffers`: how many) never enter the pseudo-gradient, a norm or the outer
step: each learner's newest ones are merged on their own (diloco.training.buffers.BufferMerge), weighted by
its tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diloco.configs import Config, OuterConfig
from diloco.run.context import LEGACY_DIRECT
from diloco.run.objects import decode_tensors, encode_tensors
from diloco.storage.codec import Header
from diloco.training.buffers import BufferMerge
from diloco.training.fp64 import Arena
from diloco.training.merge import Combiner, delta_weight
from diloco.training.outer import OuterOptimizer, OuterState
from diloco.training.tensors import Tensors, add_, clone
from diloco.trust.judge import delta_norm

__all__ = ["GradientStream", "LearnerGroup", "MergeArenas", "OuterOptimizer", "OuterState", "StepResult",
           "gradient_stream", "outer_optimizer", "outer_step"]


@dataclass
class MergeArenas:
    """The memory a merger keeps between its merges (diloco.run.heap.Arena), one merge at a time: the block
    its fp64 sums are laid in, and the fp32 block its deltas are first decoded into and its pseudo-gradient
    is written to. The largest chain's size: 12 B a parameter of it, what each merge's peak held anyway."""

    sums: Arena = field(default_factory=lambda: Arena(torch.float64))
    buffers: Arena = field(default_factory=lambda: Arena(torch.float32))


@dataclass
class LearnerGroup:
    """All deltas of one learner merged in one version, summed (they are successive increments)."""

    learner: str
    seqs: list[int] = field(default_factory=list)
    tokens: int = 0
    steps: int = 0
    min_base: int = 1 << 62
    total: Tensors | None = None
    buffers: Tensors | None = None  # the buffers of its newest delta (its state now, not a sum)

    def add(self, seq: int, header: Header, delta: Tensors) -> None:
        """A judged delta (its buffers, if any, after its parameters: taken off here)."""
        meta = header.meta
        count = meta.get("buffers", 0)
        if count:
            self.buffers = {name: delta.pop(name) for name in list(delta)[-count:]}
        self.seqs.append(seq)
        self.tokens += int(meta["tokens"])
        self.steps += int(meta["steps"])
        self.min_base = min(self.min_base, int(meta["base_version"]))
        if self.total is None:
            self.total = delta
        else:
            add_(self.total, delta)

    def counted(self, bounds: CounterBounds | None) -> tuple[int, int]:
        """(tokens, steps) the merge counts for this group: its headers' sums, within `bounds` (None: as
        claimed)."""
        if bounds is None:
            return self.tokens, self.steps
        steps = min(self.steps, bounds.max_steps)
        tokens = self.tokens if bounds.max_tokens_per_step is None else \
            min(self.tokens, math.floor(steps * bounds.max_tokens_per_step))
        return tokens, steps

    def weight(self, version: int, staleness_power: float, bounds: CounterBounds | None = None) -> float:
        staleness = max(0, version - self.min_base)
        tokens, steps = self.counted(bounds)
        return delta_weight(tokens, steps, staleness, staleness_power)


TOKENS_SLACK = 1.25  # a learner's tokens per step count up to this x the run's (batches of varying length)


@dataclass(frozen=True)
class CounterBounds:
    """What one learner's counters can count for in one merge (its weight, the round share): the steps of
    `merger.max_phases_per_merge` phases, and TOKENS_SLACK x run.json's tokens per step (None: an older run
    that did not record it)."""

    max_steps: int
    max_tokens_per_step: float | None


def counter_bounds(cfg: Config, tokens_per_step: int | None) -> CounterBounds | None:
    """The bounds of the run's merges (`cfg`: the live config, `tokens_per_step`: RunContext.tokens_per_step);
    None for a run created before run.json recorded its tokens per step (its merges counted the counters as
    claimed, and audit replays them so)."""
    if tokens_per_step is None:
        return None
    return CounterBounds(max(1, math.floor(cfg.merger.max_phases_per_merge * cfg.inner.steps_per_phase)),
                         TOKENS_SLACK * tokens_per_step)


@dataclass
class StepResult:
    update_bytes: bytes
    params: Tensors  # the new global: old params + dequantize(update)
    outer: OuterState
    weights: dict[str, float]  # learner -> normalised weight
    update_norm: float
    scale: float  # share of a full round's steps this merge carries (1.0 without partial scaling)
    # the merged buffers (None: no learner's were taken; the parent's carry forward)
    buffers: Tensors | None = None


class GradientStream:
    """Fold learner groups into the combined pseudo-gradient one at a time (memory: one accumulator,
    whatever the number of learners); `finish` hands back the combination and the normalised weights.
    `direct` names the tensors averaged directly under RDA (the paper's embeddings); `buffers` the buffers the
    chain merges (run.json's): each group's newest are folded by its tokens."""

    def __init__(self, version: int, merge_rule: str, staleness_power: float, direct: tuple[str, ...] = (),
                 buffers: list[dict] = (), bounds: CounterBounds | None = None,
                 arena: Arena | None = None) -> None:
        self.version, self.staleness_power, self.bounds = version, staleness_power, bounds
        self.combiner = Combiner(merge_rule, direct=direct, arena=arena)
        self.buffer_merge = BufferMerge(list(buffers)) if buffers else None
        self.weights: dict[str, float] = {}
        # merged, as counted (within `bounds`): the run's tokens_total, token budget and schedule clock
        self.tokens = 0
        self.steps = 0  # merged: the outer optimizer's round share counts these

    def add(self, group: LearnerGroup, consume: bool = False,
            on_folded: Callable[[int], None] | None = None,
            recycle: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """Fold `group` in; `consume`: its tensors are freed one by one as they are folded (no one else may
        hold them), or handed to `recycle(name, tensor)`; `on_folded(i)` called after the i-th."""
        weight = group.weight(self.version, self.staleness_power, self.bounds)
        self.weights[group.learner] = weight
        tokens, steps = group.counted(self.bounds)
        self.tokens += tokens
        self.steps += steps
        self.combiner.add(group.total, weight, consume=consume, on_folded=on_folded, recycle=recycle)
        group.total = None  # released: the combiner holds all that is needed
        if group.buffers is not None and self.buffer_merge is not None:
            self.buffer_merge.add(tokens, group.buffers)  # tokens / all merged (no staleness)
        group.buffers = None

    def merged_buffers(self) -> Tensors | None:
        """The merged buffers, or None when no group carried any (the chain's parent's carry forward)."""
        return None if self.buffer_merge is None else self.buffer_merge.finish()

    def finish(self, into: Callable[[str], torch.Tensor | None] | None = None,
               ) -> tuple[Tensors | None, dict[str, float]]:
        """(combined pseudo-gradient, learner -> normalised weight); None when nothing has weight. `into`:
        fp32 buffers the pseudo-gradient may be written to (Combiner.take_result)."""
        total_w = sum(self.weights.values())
        normalised = {k: (w / total_w if total_w > 0 else 0.0) for k, w in self.weights.items()}
        if not self.weights or total_w <= 0:
            return None, normalised
        return self.combiner.take_result(into), normalised  # the fp64 sums freed tensor by tensor


def gradient_stream(params: Tensors, version: int, outer: OuterConfig,
                    direct: tuple[str, ...] | None = None, buffers: list[dict] = (),
                    bounds: CounterBounds | None = None, arena: Arena | None = None) -> GradientStream:
    """The stream of the merge on top of `version`, with the run's merge rule and staleness power; `direct`:
    the tensors averaged directly (the run's layout marks its embeddings; None: the built-in GPT's);
    `buffers`: the buffers the chain merges (RunContext.buffers); `bounds`: what a learner's counters count
    for (counter_bounds; None: as claimed, the merges of runs made before the bound); `arena`: the merger's
    kept fp64 block the sums are laid in (None: fresh zeros)."""
    if direct is None:
        direct = tuple(k for k in params if k in LEGACY_DIRECT)  # the paper averages embeddings directly
    return GradientStream(version, outer.merge_rule, outer.staleness_power, direct=direct, buffers=buffers,
                          bounds=bounds, arena=arena)


def outer_optimizer(cfg: Config, num_learners: int) -> OuterOptimizer:
    """The run's outer optimizer; a round is every one of `num_learners` learners' phase."""
    steps_per_round = cfg.inner.steps_per_phase * max(1, num_learners)
    return OuterOptimizer(cfg.outer, cfg.experimental, steps_per_round)


def outer_step(params: Tensors, outer: OuterState, stream: GradientStream, fingerprint: str,
               optimizer: OuterOptimizer) -> StepResult:
    """Combine, the outer step, quantize the exact update, keep what quantization left as the residual."""
    grad, normalised = stream.finish()
    update = optimizer.update(params, outer, grad, stream.steps)
    update_bytes = encode_tensors(update.exact, codec_name=optimizer.update_codec, kind="update",
                                    fingerprint=fingerprint, meta={"version": stream.version + 1})
    _, shipped = decode_tensors(update_bytes)
    new_global = clone(params)
    add_(new_global, shipped)
    norm = delta_norm(shipped, chunked=True)
    return StepResult(update_bytes, new_global, optimizer.state_after(update, shipped), normalised, norm,
                      update.share, stream.merged_buffers())

"""The deterministic core of one merge: validate -> fold the deltas (GradientStream) -> the outer
optimizer -> quantize the update (`outer.update_codec`) -> new global. Shared by the merger and `audit`.

Contract: outer_step is a pure function of (params, outer state, the merged deltas in decision order,
the optimizer); replaying it on the stored objects reproduces the committed bits. The buffers a delta carries
after its parameters (header meta `buffers`: how many) never enter the pseudo-gradient, a norm or the outer step:
each learner's newest ones are merged on their own (diloco.training.buffers.BufferMerge), weighted by its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.configs import Config, OuterConfig
from diloco.run.context import LEGACY_DIRECT
from diloco.run.objects import decode_tensors, encode_tensors
from diloco.storage.codec import Header, codec_of
from diloco.training.buffers import BufferMerge, check_values
from diloco.training.merge import Combiner, delta_weight
from diloco.training.outer import OuterOptimizer, OuterState
from diloco.training.tensors import Tensors, add_, all_finite, clone, same_layout

__all__ = ["NON_FINITE", "DeltaInvalid", "DeltaStale", "GradientStream", "LearnerGroup", "OuterOptimizer", "OuterState", "StepResult",
           "gradient_stream", "outer_optimizer", "outer_step", "split_buffers", "validate_delta"]


class DeltaInvalid(ValueError):
    """A delta failed validation; the message is the reason recorded in the manifest."""


class DeltaStale(DeltaInvalid):
    """A delta built on a version older than `outer.max_staleness` allows (slow, not suspect)."""


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

    def weight(self, version: int, staleness_power: float) -> float:
        staleness = max(0, version - self.min_base)
        return delta_weight(self.tokens, self.steps, staleness, staleness_power)


NON_FINITE = "non-finite values (NaN or Inf)"  # the reason recorded for a delta with a NaN or an Inf


def split_buffers(header: Header, delta: Tensors, layout: list[dict]) -> Tensors:
    """Take a decoded delta's buffers off it (its last `meta.buffers` tensors) and check them against the buffers the
    chain merges (`layout`, run.json's): every one, in order, with its shape, stored exactly (fp32), finite, integral
    in an integer buffer. DeltaInvalid naming what is wrong; a chain without buffers takes deltas without any."""
    count = header.meta.get("buffers", 0)
    if type(count) is not int or not 0 <= count <= len(delta):
        raise DeltaInvalid(f"bad header field buffers: {count!r:.40}")
    if count != len(layout):
        names = ", ".join(e["name"] for e in layout[:6]) or "none"
        raise DeltaInvalid(f"carries {count} buffers where the run merges {len(layout)} ({names})")
    specs = header.tensors[len(header.tensors) - count:]
    for i, (spec, entry) in enumerate(zip(specs, layout, strict=True)):
        if spec.name != entry["name"] or list(spec.shape) != list(entry["shape"]):
            raise DeltaInvalid(f"buffer {i} is {spec.name!r:.80} of shape {list(spec.shape)}, where the run has "
                               f"{entry['name']!r} of shape {entry['shape']}")
        if codec_of(header, spec) != "fp32":
            raise DeltaInvalid(f"buffer {spec.name!r} is stored as {codec_of(header, spec)}, not exactly (fp32)")
    buffers = {spec.name: delta.pop(spec.name) for spec in specs}
    why = check_values(buffers, layout)
    if why is not None:
        raise DeltaInvalid(why)
    return buffers


def validate_delta(header: Header, delta: Tensors, *, learner: str, seq: int, version: int,
                   params: Tensors, cfg: Config, check_finite: bool = True) -> int:
    """Check one decoded delta against its key, the current version and the model; returns staleness.
    The last check, every value finite, is the caller's when `check_finite` is False (the judge folds it
    into the delta's fp64 norm)."""
    meta = header.meta
    if header.kind != "delta":
        raise DeltaInvalid(f"not a delta (kind {header.kind!r})")
    if meta.get("learner") != learner or meta.get("seq") != seq:
        raise DeltaInvalid(f"header says {meta.get('learner')!r}/{meta.get('seq')!r}, key says {learner}/{seq}")
    for name in ("base_version", "tokens", "steps"):
        value = meta.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DeltaInvalid(f"bad header field {name}: {value!r}")
    if meta["steps"] == 0 or meta["tokens"] == 0:
        raise DeltaInvalid("empty delta (0 steps or 0 tokens)")
    base = meta["base_version"]
    if base > version:
        raise DeltaInvalid(f"base version {base} is newer than the current version {version}")
    staleness = version - base
    if staleness > cfg.outer.max_staleness:
        raise DeltaStale(f"stale: staleness {staleness} > max_staleness {cfg.outer.max_staleness}")
    if not same_layout(delta, params):
        raise DeltaInvalid("tensor names or shapes do not match the model")
    if check_finite and not all_finite(delta):
        raise DeltaInvalid(NON_FINITE)
    return staleness


@dataclass
class StepResult:
    update_bytes: bytes
    params: Tensors  # the new global: old params + dequantize(update)
    outer: OuterState
    weights: dict[str, float]  # learner -> normalised weight
    update_norm: float
    scale: float  # share of a full round's steps this merge carries (1.0 without partial scaling)
    buffers: Tensors | None = None  # the merged buffers (None: no learner's were taken; the parent's carry forward)


class GradientStream:
    """Fold learner groups into the combined pseudo-gradient one at a time (memory: one accumulator,
    whatever the number of learners); `finish` hands back the combination and the normalised weights.
    `direct` names the tensors averaged directly under RDA (the paper's embeddings); `buffers` the buffers the
    chain merges (run.json's): each group's newest are folded by its tokens."""

    def __init__(self, version: int, merge_rule: str, staleness_power: float, direct: tuple[str, ...] = (),
                 buffers: list[dict] = ()) -> None:
        self.version, self.staleness_power = version, staleness_power
        self.combiner = Combiner(merge_rule, direct=direct)
        self.buffer_merge = BufferMerge(list(buffers)) if buffers else None
        self.weights: dict[str, float] = {}
        self.tokens = 0  # merged, for the record
        self.steps = 0  # merged: the outer optimizer's round share counts these

    def add(self, group: LearnerGroup) -> None:
        weight = group.weight(self.version, self.staleness_power)
        self.weights[group.learner] = weight
        self.tokens += group.tokens
        self.steps += group.steps
        self.combiner.add(group.total, weight)
        group.total = None  # released: the combiner holds all that is needed
        if group.buffers is not None and self.buffer_merge is not None:
            self.buffer_merge.add(group.tokens, group.buffers)  # weights tokens / all merged tokens (no staleness)
        group.buffers = None

    def merged_buffers(self) -> Tensors | None:
        """The merged buffers, or None when no group carried any (the chain's parent's carry forward)."""
        return None if self.buffer_merge is None else self.buffer_merge.finish()

    def finish(self) -> tuple[Tensors | None, dict[str, float]]:
        """(combined pseudo-gradient, learner -> normalised weight); None when nothing has weight."""
        total_w = sum(self.weights.values())
        normalised = {k: (w / total_w if total_w > 0 else 0.0) for k, w in self.weights.items()}
        if not self.weights or total_w <= 0:
            return None, normalised
        return self.combiner.take_result(), normalised  # the fp64 sums freed tensor by tensor


def gradient_stream(params: Tensors, version: int, outer: OuterConfig,
                    direct: tuple[str, ...] | None = None, buffers: list[dict] = ()) -> GradientStream:
    """The stream of the merge on top of `version`, with the run's merge rule and staleness power; `direct`:
    the tensors averaged directly (the run's layout marks its embeddings; None: the built-in GPT's); `buffers`:
    the buffers the chain merges (RunContext.buffers)."""
    if direct is None:
        direct = tuple(k for k in params if k in LEGACY_DIRECT)  # the paper averages embeddings directly
    return GradientStream(version, outer.merge_rule, outer.staleness_power, direct=direct, buffers=buffers)


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
    norm = float(torch.sqrt(sum((v.double() ** 2).sum() for v in shipped.values())))
    return StepResult(update_bytes, new_global, optimizer.state_after(update, shipped), normalised, norm,
                      update.share, stream.merged_buffers())

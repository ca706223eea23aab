"""The deterministic core of one merge: validated deltas -> combined pseudo-gradient -> Nesterov
-> quantized update -> new global. Shared by the merger and by `audit` replay.

Contract: a pure function of (params, outer state, the merged deltas in decision order, config);
replaying it on the stored objects reproduces the committed bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.configs import Config
from diloco.run.objects import decode_tensors, encode_tensors
from diloco.storage.codec import CodecError, Header
from diloco.training.merge import Combiner, delta_weight
from diloco.training.model import EMBEDDING_PARAMS
from diloco.training.outer import nesterov_step
from diloco.training.tensors import Tensors, add_, all_finite, clone, same_layout


class DeltaInvalid(ValueError):
    """A delta failed validation; the message is the reason recorded in the manifest."""


@dataclass
class LearnerGroup:
    """All deltas of one learner merged in one version, summed (they are successive increments)."""

    learner: str
    seqs: list[int] = field(default_factory=list)
    tokens: int = 0
    steps: int = 0
    min_base: int = 1 << 62
    total: Tensors | None = None

    def add(self, seq: int, header: Header, delta: Tensors) -> None:
        meta = header.meta
        self.seqs.append(seq)
        self.tokens += int(meta["tokens"])
        self.steps += int(meta["steps"])
        self.min_base = min(self.min_base, int(meta["base_version"]))
        if self.total is None:
            self.total = delta
        else:
            add_(self.total, delta)

    def weight(self, version: int, cfg: Config) -> float:
        staleness = max(0, version - self.min_base)
        return delta_weight(self.tokens, self.steps, staleness, cfg.outer.staleness_power)


def validate_delta(header: Header, delta: Tensors, *, learner: str, seq: int, version: int,
                   params: Tensors, cfg: Config) -> int:
    """Check one decoded delta against its key, the current version and the model; returns staleness."""
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
        raise DeltaInvalid(f"stale: staleness {staleness} > max_staleness {cfg.outer.max_staleness}")
    if not same_layout(delta, params):
        raise DeltaInvalid("tensor names or shapes do not match the model")
    if not all_finite(delta):
        raise DeltaInvalid("non-finite values (NaN or Inf)")
    return staleness


@dataclass
class OuterState:
    momentum: Tensors
    residual: Tensors

    @classmethod
    def zeros_like(cls, params: Tensors) -> OuterState:
        return cls({k: torch.zeros_like(v) for k, v in params.items()},
                   {k: torch.zeros_like(v) for k, v in params.items()})

    def to_tensors(self) -> Tensors:
        out = {f"momentum/{k}": v for k, v in self.momentum.items()}
        out.update({f"residual/{k}": v for k, v in self.residual.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: Tensors, params: Tensors) -> OuterState:
        try:
            return cls({k: tensors[f"momentum/{k}"] for k in params}, {k: tensors[f"residual/{k}"] for k in params})
        except KeyError as err:
            raise CodecError(f"outer state lacks tensor {err}") from None


@dataclass
class StepResult:
    update_bytes: bytes
    params: Tensors  # the new global: old params + dequantize(update)
    outer: OuterState
    weights: dict[str, float]  # learner -> normalised weight
    update_norm: float
    scale: float  # share of a full round's tokens this merge carries (1.0 without partial scaling)


class GradientStream:
    """Fold learner groups into the combined pseudo-gradient one at a time (memory: one
    accumulator, whatever the number of learners); then `finish` scales it by the round share."""

    def __init__(self, params: Tensors, version: int, cfg: Config, num_learners: int) -> None:
        self.version, self.cfg, self.num_learners = version, cfg, num_learners
        direct = tuple(k for k in params if k in EMBEDDING_PARAMS)  # the paper averages embeddings directly
        self.combiner = Combiner(cfg.outer.merge_rule, direct=direct)
        self.weights: dict[str, float] = {}
        self.tokens = 0

    def add(self, group: LearnerGroup) -> None:
        weight = group.weight(self.version, self.cfg)
        self.weights[group.learner] = weight
        self.tokens += group.tokens
        self.combiner.add(group.total, weight)
        group.total = None  # released: the combiner holds all that is needed

    def rounds(self) -> float:
        """Tokens merged / tokens of a full round (every learner one phase); 1.0 without partial scaling."""
        if not self.cfg.outer.partial_scaling:
            return 1.0
        cfg = self.cfg
        per_phase = cfg.inner.steps_per_phase * cfg.data.batch_size * cfg.model.ctx_len
        return self.tokens / (max(1, self.num_learners) * per_phase)

    def round_share(self) -> float:
        """rounds(), capped at 1: the scale of a partial merge's pseudo-gradient."""
        return min(1.0, self.rounds())

    def finish(self) -> tuple[Tensors | None, dict[str, float], float]:
        total_w = sum(self.weights.values())
        normalised = {k: (w / total_w if total_w > 0 else 0.0) for k, w in self.weights.items()}
        scale = self.round_share()
        if not self.weights or total_w <= 0:
            return None, normalised, scale
        grad = self.combiner.result()
        if scale != 1.0:
            grad = {k: v * scale for k, v in grad.items()}
        return grad, normalised, scale


def outer_step(params: Tensors, outer: OuterState, stream: GradientStream, fingerprint: str) -> StepResult:
    """Nesterov step on the streamed pseudo-gradient, then quantize the update (error feedback)."""
    grad, normalised, scale = stream.finish()
    cfg = stream.cfg
    if grad is not None:
        # A backlog (the merger or the storage was down): several rounds of progress in one merge. The step
        # applies all of it, but the momentum buffer takes it at one round's rate (grad / rounds), so momentum
        # does not re-apply the whole backlog on every following merge (which spiked the loss after outages).
        rounds = stream.rounds()
        spread = rounds > 1.0 and cfg.outer.backlog_momentum == "round_rate"
        rate = {k: v / rounds for k, v in grad.items()} if spread else grad
        share = min(1.0, rounds) if cfg.outer.momentum_per == "round" and rounds > 0 else 1.0
        new_params, momentum = nesterov_step(params, rate, outer.momentum, cfg.outer.lr,
                                             cfg.outer.momentum, cfg.outer.nesterov, share=share)
        if rate is not grad:
            for k in new_params:
                new_params[k] -= cfg.outer.lr * (grad[k] - rate[k])
        exact = {k: (new_params[k] - params[k]) + outer.residual[k] for k in params}
    else:  # every delta was rejected: a no-op version that records the decisions
        momentum = outer.momentum
        exact = {k: outer.residual[k].clone() for k in params}
    version = stream.version
    update_bytes = encode_tensors(exact, codec_name=cfg.outer.update_codec, kind="update",
                                    fingerprint=fingerprint, meta={"version": version + 1})
    _, shipped = decode_tensors(update_bytes)
    residual = {k: exact[k] - shipped[k] for k in params}
    new_global = clone(params)
    add_(new_global, shipped)
    norm = float(torch.sqrt(sum((v.double() ** 2).sum() for v in shipped.values())))
    return StepResult(update_bytes, new_global, OuterState(momentum, residual), normalised, norm, scale)

"""The deterministic core of one merge: validated deltas -> combined pseudo-gradient -> Nesterov
-> quantized update -> new global. Shared by the merger and by `audit` replay.

Contract: a pure function of (params, outer state, the merged deltas in decision order, config);
replaying it on the stored objects reproduces the committed bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.configs import Config
from diloco.engine import tensors as T
from diloco.storage.codec import CodecError, Header
from diloco.training.merge import Combiner, delta_weight
from diloco.training.model import EMBEDDING_PARAMS
from diloco.training.outer import nesterov_step


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
    total: T.Tensors | None = None

    def add(self, seq: int, header: Header, delta: T.Tensors) -> None:
        meta = header.meta
        self.seqs.append(seq)
        self.tokens += int(meta["tokens"])
        self.steps += int(meta["steps"])
        self.min_base = min(self.min_base, int(meta["base_version"]))
        if self.total is None:
            self.total = delta
        else:
            T.add_(self.total, delta)

    def weight(self, version: int, cfg: Config) -> float:
        staleness = max(0, version - self.min_base)
        return delta_weight(self.tokens, self.steps, staleness, cfg.outer.staleness_power)


def validate_delta(header: Header, delta: T.Tensors, *, learner: str, seq: int, version: int,
                   params: T.Tensors, cfg: Config) -> int:
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
    if not T.same_layout(delta, params):
        raise DeltaInvalid("tensor names or shapes do not match the model")
    if not T.all_finite(delta):
        raise DeltaInvalid("non-finite values (NaN or Inf)")
    return staleness


@dataclass
class OuterState:
    momentum: T.Tensors
    residual: T.Tensors

    @classmethod
    def zeros_like(cls, params: T.Tensors) -> OuterState:
        return cls({k: torch.zeros_like(v) for k, v in params.items()},
                   {k: torch.zeros_like(v) for k, v in params.items()})

    def to_tensors(self) -> T.Tensors:
        out = {f"momentum/{k}": v for k, v in self.momentum.items()}
        out.update({f"residual/{k}": v for k, v in self.residual.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: T.Tensors, params: T.Tensors) -> OuterState:
        try:
            return cls({k: tensors[f"momentum/{k}"] for k in params}, {k: tensors[f"residual/{k}"] for k in params})
        except KeyError as err:
            raise CodecError(f"outer state lacks tensor {err}") from None


@dataclass
class StepResult:
    update_bytes: bytes
    params: T.Tensors  # the new global: old params + dequantize(update)
    outer: OuterState
    weights: dict[str, float]  # learner -> normalised weight
    update_norm: float
    scale: float  # share of a full round's tokens this merge carries (1.0 without partial scaling)


def round_share(groups: list[LearnerGroup], num_learners: int, cfg: Config) -> float:
    """Tokens merged / tokens of a full round (every learner one phase), capped at 1."""
    if not cfg.outer.partial_scaling:
        return 1.0
    per_phase = cfg.inner.steps_per_phase * cfg.data.batch_size * cfg.model.ctx_len
    full_round = max(1, num_learners) * per_phase
    return min(1.0, sum(g.tokens for g in groups) / full_round)


def outer_step(params: T.Tensors, outer: OuterState, groups: list[LearnerGroup], version: int,
               cfg: Config, fingerprint: str, num_learners: int) -> StepResult:
    """Combine the groups (in the given order), scale by the round share, take the Nesterov step,
    quantize the update."""
    weights = {g.learner: g.weight(version, cfg) for g in groups}
    total_w = sum(weights.values())
    scale = round_share(groups, num_learners, cfg)
    if groups and total_w > 0:
        direct = tuple(k for k in params if k in EMBEDDING_PARAMS)  # the paper averages embeddings directly
        combiner = Combiner(cfg.outer.merge_rule, direct=direct)
        for g in groups:
            combiner.add(g.total, weights[g.learner])
        grad = combiner.result()
        if scale != 1.0:
            grad = {k: v * scale for k, v in grad.items()}
        new_params, momentum = nesterov_step(params, grad, outer.momentum, cfg.outer.lr,
                                             cfg.outer.momentum, cfg.outer.nesterov)
        exact = {k: (new_params[k] - params[k]) + outer.residual[k] for k in params}
    else:  # every delta was rejected: a no-op version that records the decisions
        momentum = outer.momentum
        exact = {k: outer.residual[k].clone() for k in params}
    update_bytes = T.encode_tensors(exact, codec_name=cfg.outer.update_codec, kind="update",
                                    fingerprint=fingerprint, meta={"version": version + 1})
    _, shipped = T.decode_tensors(update_bytes)
    residual = {k: exact[k] - shipped[k] for k in params}
    new_global = T.clone(params)
    T.add_(new_global, shipped)
    norm = float(torch.sqrt(sum((v.double() ** 2).sum() for v in shipped.values())))
    normalised = {k: (w / total_w if total_w > 0 else 0.0) for k, w in weights.items()}
    return StepResult(update_bytes, new_global, OuterState(momentum, residual), normalised, norm, scale)

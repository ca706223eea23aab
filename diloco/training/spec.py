"""The TrainSpec contract: the one seam where a user's model, data, loss and optimizer enter the engine.

Contract (docs/SPEC.md): `build_model()` -> nn.Module, called under a fixed seed (the same init everywhere);
`batches(shard, num_shards, start)` -> an iterator from batch index `start` (batch i of a shard depends only
on (seed, shard, i), so a cursor resumes it); `loss(model, batch)` -> (scalar loss tensor, num_tokens: int),
the tokens weigh the merge; optional `eval_batches()`, `build_optimizer(params)`, `lr_at(step)` (a multiplier
of each parameter group's lr), `sample(model)`, `metric_name`, `export(model, folder)` (a folder in the
model's own format), and `data_source` (one line naming the data, shown when a run is created). A batch is a
tensor or a tuple/list/dict of tensors. The model's layout (parameter names, shapes, dtypes; tied weights
once) is what a run records and checks; its persistent buffers are recorded and merged beside it
(diloco.training.buffers).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

Batch = Any  # a tensor, or a tuple/list/dict of tensors


class SpecError(ValueError):
    """A spec, its arguments, or something it returned is wrong; the message names what."""


@dataclass(frozen=True)
class TrainSpec:
    build_model: Callable[[], nn.Module]
    batches: Callable[[int, int, int], Iterator[Batch]]
    loss: Callable[[nn.Module, Batch], tuple[torch.Tensor, int]]
    eval_batches: Callable[[], Sequence[Batch]] | None = None
    build_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None
    lr_at: Callable[[int], float] | None = None
    sample: Callable[..., str] | None = None
    metric_name: str = "loss"
    # an extra: e.g. a Hugging Face save_pretrained folder
    export: Callable[[nn.Module, Path], None] | None = None
    # one line naming the data ("<corpus>: 12 files (3 skipped: not text)"), shown at creation
    data_source: str = ""

    def __post_init__(self) -> None:
        for name in ("build_model", "batches", "loss"):
            if not callable(getattr(self, name)):
                raise SpecError(f"TrainSpec.{name} must be callable, got "
                                f"{type(getattr(self, name)).__name__}")
        for name in ("eval_batches", "build_optimizer", "lr_at", "sample", "export"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise SpecError(f"TrainSpec.{name} must be callable or None, got {type(value).__name__}")
        if not isinstance(self.data_source, str):
            raise SpecError(f"TrainSpec.data_source must be a string, got {type(self.data_source).__name__}")
        if not isinstance(self.metric_name, str) or not self.metric_name:
            raise SpecError(f"TrainSpec.metric_name must be a non-empty string, got {self.metric_name!r}")


# ---- the model's layout -----------------------------------------------------------------------------
def check_model(model: object) -> nn.Module:
    """The model build_model returned, or SpecError: it must be an nn.Module with floating-point
    parameters."""
    if not isinstance(model, nn.Module):
        raise SpecError(f"build_model returned {type(model).__name__}, not a torch.nn.Module")
    params = list(model.named_parameters())
    if not params:
        raise SpecError("build_model returned a model without parameters")
    not_float = [n for n, p in params if not p.is_floating_point()]
    if not_float:
        raise SpecError(f"build_model's parameters must be floating point; {not_float[0]!r} is "
                        f"{params[0][1].dtype}")
    return model


def embedding_names(model: nn.Module) -> set[str]:
    """Parameters of nn.Embedding modules (by their name in named_parameters, tied weights once): the paper
    averages embeddings directly, not by radial-directional averaging."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {name for name, p in model.named_parameters() if id(p) in embedded}


def model_layout(model: nn.Module) -> list[dict[str, Any]]:
    """Every parameter once (tied weights under their first name), in named_parameters order: what a delta
    carries. Buffers are not part of it (nor of the fingerprint): run.json lists them apart
    (training.buffers)."""
    direct = embedding_names(model)
    return [{"name": name, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."),
             "direct": name in direct} for name, p in model.named_parameters()]


def layout_fingerprint(layout: list[dict[str, Any]]) -> str:
    """A stable hash of the layout: the fingerprint every tensor object of the run carries."""
    blob = json.dumps([[p["name"], p["shape"], p["dtype"]] for p in layout], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def first_difference(expected: list[dict[str, Any]], got: list[dict[str, Any]]) -> str | None:
    """The first way `got` differs from `expected` (in words), or None when they are the same layout."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        for key in ("name", "shape", "dtype"):
            if a[key] != b[key]:
                return f"parameter {i} ({a['name']!r}): {key} {b[key]} where the run has {a[key]}"
    if len(expected) != len(got):
        more, fewer = (got, expected) if len(got) > len(expected) else (expected, got)
        side = "an extra" if more is got else "no"
        return (f"{side} parameter {more[len(fewer)]['name']!r} ({len(got)} parameters, the run has "
                f"{len(expected)})")
    return None


# ---- what the spec's functions return -----------------------------------------------------------
def check_loss(out: object) -> tuple[torch.Tensor, int]:
    """loss(model, batch)'s result, or SpecError: a (scalar tensor, int >= 1) pair."""
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise SpecError(f"loss must return (scalar loss tensor, num_tokens: int), got {type(out).__name__}")
    loss, tokens = out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise SpecError(f"loss must return a scalar tensor first, got {type(loss).__name__}"
                        + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise SpecError(f"loss must return num_tokens as an int >= 1 second, got {tokens!r}")
    return loss, tokens


def to_device(batch: Batch, device: str) -> Batch:
    """The batch with every tensor moved to `device` (tuples, lists and dicts of tensors kept as they are)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def slice_batch(batch: Any, rank: int, size: int) -> Any:
    """This rank's equal slice (along dim 0) of a batch: a tensor, or a tuple/list/dict of them."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        if batch.shape[0] % size:
            raise ValueError(f"learner.ranks = {size} does not divide the batch's first dimension "
                             f"{batch.shape[0]}: "
                             "every rank takes an equal slice")
        return batch.chunk(size, dim=0)[rank]
    if isinstance(batch, tuple | list):
        return type(batch)(slice_batch(b, rank, size) for b in batch)
    if isinstance(batch, dict):
        return {k: slice_batch(v, rank, size) for k, v in batch.items()}
    return batch


def mean_loss(model: nn.Module, batches: Iterable[Batch], loss: Callable, device: str = "cpu") -> float:
    """The held-out metric: the token-weighted mean of the spec's loss over fixed batches (eval mode,
    no gradients; the model's mode is restored)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for batch in batches:
                value, tokens = check_loss(loss(model, to_device(batch, device)))
                total += value.item() * tokens
                count += tokens
    finally:
        model.train(was_training)
    if count == 0:
        raise SpecError("eval_batches returned no batches")
    result = total / count
    if not math.isfinite(result):
        raise FloatingPointError(f"held-out loss is {result}")
    return result

"""A model's buffers as a run ships and merges them: which ones, their values as fp32, loading merged values
back into a model, and the merge rule.

Contract: pure PyTorch, no I/O. The buffers that ship are the model's *persistent* buffers (those its
`state_dict()` holds besides the parameters: `register_buffer`'s default, persistent=True, is the spec's mark
that a buffer is state) of a floating, integer or bool dtype, in `named_buffers()` order; a non-persistent
buffer is rebuilt by build_model in every process and never ships. Values travel as fp32: float16, bfloat16
and float32 buffers exactly, float64 ones rounded to fp32, integer and bool ones exactly while |value| <=
2**24 (a step counter such as BatchNorm's `num_batches_tracked` is exact up to 16.7M steps, then rounded). The
merge (`BufferMerge`): a floating buffer becomes the token-weighted mean of the learners' values (sum of
tokens x value in fp64, in the order the learners are added, divided by the tokens, rounded once to fp32:
identical values come back bit for bit), an integer or bool buffer the elementwise maximum.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from diloco.training.tensors import Tensors

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64")  # merged by the maximum


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_float(entry: dict[str, Any]) -> bool:
    """Whether a buffer of the run's list (name, shape, dtype) merges by the mean (floating) or the
    maximum."""
    return entry["dtype"] in FLOAT_DTYPES


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every persistent buffer, in named_buffers order (a buffer shared under two names
    once)."""
    in_state = set(model.state_dict(keep_vars=True))
    return [(name, b) for name, b in model.named_buffers() if name in in_state]


def buffer_layout(model: nn.Module) -> tuple[list[dict[str, Any]], list[str]]:
    """(the buffers that ship: [{"name", "shape", "dtype"}], the persistent buffers that cannot, as "name
    (dtype)": a complex or quantized dtype, which fp32 cannot carry)."""
    ships, cannot = [], []
    for name, b in persistent_buffers(model):
        dtype = dtype_name(b.dtype)
        if dtype in FLOAT_DTYPES or dtype in INT_DTYPES:
            ships.append({"name": name, "shape": list(b.shape), "dtype": dtype})
        else:
            cannot.append(f"{name} ({dtype})")
    return ships, cannot


def buffer_difference(expected: list[dict[str, Any]], got: list[dict[str, Any]]) -> str | None:
    """The first way a model's buffers (`got`) differ from the run's (in words), or None when they are the
    same."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        for key in ("name", "shape", "dtype"):
            if a[key] != b[key]:
                return f"buffer {i} ({a['name']!r}): {key} {b[key]} where the run has {a[key]}"
    if len(expected) != len(got):
        more, fewer = (got, expected) if len(got) > len(expected) else (expected, got)
        side = "an extra" if more is got else "no"
        return f"{side} buffer {more[len(fewer)]['name']!r} ({len(got)} buffers, the run has {len(expected)})"
    return None


def get_buffers(model: nn.Module, layout: list[dict[str, Any]]) -> Tensors:
    """The run's buffers of the model, as fp32 CPU copies in the run's order ({} for a run without
    buffers)."""
    if not layout:
        return {}
    own = dict(model.named_buffers())
    return {e["name"]: own[e["name"]].detach().to("cpu", torch.float32, copy=True).contiguous()
            for e in layout}


def set_buffers(model: nn.Module, values: Tensors, layout: list[dict[str, Any]]) -> None:
    """Copy the run's buffers into the model (each cast to its own dtype and device). ValueError, and nothing
    changed, when the names or shapes are not the run's."""
    own = dict(model.named_buffers())
    if {e["name"] for e in layout} != set(values) or any(e["name"] not in own for e in layout):
        raise ValueError(f"buffers differ: the run has {[e['name'] for e in layout][:8]}, given "
                         f"{list(values)[:8]}")
    for e in layout:
        if tuple(values[e["name"]].shape) != tuple(own[e["name"]].shape):
            raise ValueError(f"buffer {e['name']}: shape {tuple(values[e['name']].shape)} != "
                             f"{tuple(own[e['name']].shape)}")
    with torch.no_grad():
        for e in layout:
            own[e["name"]].copy_(values[e["name"]])


def check_values(values: Tensors, layout: list[dict[str, Any]]) -> str | None:
    """Why a learner's buffer values cannot be merged (a NaN or an Inf; a fraction in an integer buffer), or
    None."""
    for e in layout:
        v = values[e["name"]]
        if not bool(torch.isfinite(v).all()):
            return f"buffer {e['name']!r} holds non-finite values (NaN or Inf)"
        if not is_float(e) and not torch.equal(v, torch.round(v)):
            return f"buffer {e['name']!r} ({e['dtype']}) holds values that are not integers"
    return None


class BufferMerge:
    """The merged buffers of one merge, folded learner by learner (one accumulator, whatever the learners):
    add each merged learner's newest buffer values with its tokens in the merge, in the merge's order;
    finish() gives them."""

    def __init__(self, layout: list[dict[str, Any]]) -> None:
        self.layout = layout
        self.tokens = 0
        self._acc: Tensors = {}

    def add(self, tokens: int, values: Tensors) -> None:
        for e in self.layout:
            name, value = e["name"], values[e["name"]]
            if is_float(e):
                term = value.double() * float(tokens)  # (fp64: tokens are exact below 2**53)
                self._acc[name] = term if name not in self._acc else self._acc[name].add_(term)
            else:
                self._acc[name] = (value.clone() if name not in self._acc
                                   else torch.maximum(self._acc[name], value))
        self.tokens += tokens

    def finish(self) -> Tensors | None:
        """The merged buffers (fp32, in the run's order), or None when no learner's were added."""
        if not self.tokens:
            return None
        return {e["name"]: (self._acc[e["name"]] / self.tokens).float() if is_float(e)
                else self._acc[e["name"]] for e in self.layout}

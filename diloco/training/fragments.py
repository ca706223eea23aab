"""Fragments: a deterministic split of the model's parameters into P balanced parts (Streaming DiLoCo).

Contract: plan_fragments is a pure function of (layout, count): every element of every parameter lies in
exactly one fragment; whole tensors are packed largest first (LPT) onto the lightest fragment, a tensor
larger than total/P is first split by rows; count = 1 is one fragment holding every tensor whole.
"""

from __future__ import annotations

import math
from typing import Any

import torch

Tensors = dict[str, torch.Tensor]


class FragmentError(ValueError):
    """fragments.count cannot split this model; the message names the field."""


def _numel(shape: list[int]) -> int:
    return math.prod(int(d) for d in shape)


def _piece(entry: dict[str, Any], rows: tuple[int, int] | None) -> dict[str, Any]:
    shape = list(entry["shape"])
    if rows is not None:
        shape = [rows[1] - rows[0], *shape[1:]]
    key = entry["name"] if rows is None else f"{entry['name']}[{rows[0]}:{rows[1]}]"
    return {"key": key, "name": entry["name"], "rows": None if rows is None else list(rows), "shape": shape,
            "dtype": entry.get("dtype", "float32"), "direct": bool(entry.get("direct", False)),
            "numel": _numel(shape)}


def _split(entry: dict[str, Any], target: int) -> list[dict[str, Any]]:
    """One piece, or row ranges of about `target` elements when the tensor is bigger (balanced rows)."""
    shape = list(entry["shape"])
    numel = _numel(shape)
    if numel <= target or len(shape) == 0 or shape[0] < 2:
        return [_piece(entry, None)]
    num_rows = int(shape[0])
    parts = min(num_rows, math.ceil(numel / max(1, target)))
    bounds = [num_rows * i // parts for i in range(parts + 1)]
    return [_piece(entry, (bounds[i], bounds[i + 1])) for i in range(parts)]


def plan_fragments(layout: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """[{"index": p, "numel": n, "pieces": [{"key", "name", "rows", "shape", "dtype", "direct", "numel"}]}];
    pieces of a fragment in layout order. FragmentError when a fragment would be empty."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise FragmentError(f"fragments.count must be an int >= 1, got {count!r}")
    if not layout:
        raise FragmentError("fragments.count needs the model's layout, and it is empty")
    if count == 1:
        pieces = [_piece(e, None) for e in layout]
        return [{"index": 0, "numel": sum(p["numel"] for p in pieces), "pieces": pieces}]
    total = sum(_numel(e["shape"]) for e in layout)
    target = math.ceil(total / count)
    pieces = [p for e in layout for p in _split(e, target)]
    if len(pieces) < count:
        raise FragmentError(f"fragments.count ({count}) is more than the model's {len(pieces)} tensors and "
                            "row ranges: some fragment would be empty")
    order = {p["key"]: i for i, p in enumerate(pieces)}
    loads, members = [0] * count, [[] for _ in range(count)]
    for piece in sorted(pieces, key=lambda p: (-p["numel"], order[p["key"]])):  # LPT, ties in layout order
        p = min(range(count), key=lambda i: (loads[i], i))
        loads[p] += piece["numel"]
        members[p].append(piece)
    if any(not m for m in members):
        raise FragmentError(f"fragments.count ({count}) leaves a fragment empty for this model")
    return [{"index": p, "numel": loads[p], "pieces": sorted(members[p], key=lambda x: order[x["key"]])}
            for p in range(count)]


def fragment_layout(fragment: dict[str, Any]) -> list[dict[str, Any]]:
    """The layout of one fragment's tensors (name = piece key): what its merger and audit work from."""
    return [{"name": p["key"], "shape": list(p["shape"]), "dtype": p["dtype"], "direct": p["direct"]}
            for p in fragment["pieces"]]


def take(tensors: Tensors, fragment: dict[str, Any], copy: bool = True) -> Tensors:
    """The fragment's tensors out of whole-model `tensors` (copies unless copy=False: views)."""
    out: Tensors = {}
    for p in fragment["pieces"]:
        t = tensors[p["name"]].detach()
        if p["rows"] is not None:
            t = t[p["rows"][0]:p["rows"][1]]
        out[p["key"]] = t.clone() if copy else t
    return out


def put_(tensors: Tensors, fragment: dict[str, Any], values: Tensors) -> None:
    """Write one fragment's `values` into whole-model `tensors`, in place."""
    for p in fragment["pieces"]:
        t = tensors[p["name"]]
        target = t if p["rows"] is None else t[p["rows"][0]:p["rows"][1]]
        target.copy_(values[p["key"]])


def owned_by(shard: int, num_shards: int, count: int) -> list[int]:
    """The fragments merger shard `shard` of `num_shards` owns: p % S == s."""
    if not 0 <= shard < num_shards:
        raise FragmentError(f"merger shard {shard} is not in [0, merger.shards={num_shards})")
    return [p for p in range(count) if p % num_shards == shard]


def due_offset(index: int, count: int, steps_per_phase: int) -> int:
    """The step offset in a phase at which fragment `index` ships: index * H / P (floored)."""
    return index * steps_per_phase // count

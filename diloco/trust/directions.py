"""The direction of each merged delta over a finished run, against what the merge had beside it — to judge
a direction check (issue #44, invariant 6: a sign-flipped delta at an honest norm passes the norm rule) before
any rule is built on it.

Contract: read-only; per merge of every chain, each merged learner's delta (its deltas of that merge summed,
the parameters only: buffers never enter a direction) gets two cosines, in fp64 over every parameter:
`cos_others`, with the sum of the other learners' deltas of the same merge (None when it had no other), and
`cos_update`, with the update the merge's parent version shipped (None at version 1, or when the parent's
update is gone). A sign-flipped delta's cosines are exactly the negatives of the honest delta's, so the
honest distribution alone says whether a threshold can tell them apart. Versions whose deltas retention
removed are skipped. Memory: one merge's deltas at a time, as fp64 flat vectors — an offline tool for the
runs this project measures, not for the merger.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from diloco.run.context import RunContext
from diloco.run.fragments import chain_contexts, manifests
from diloco.run.objects import read_tensors
from diloco.storage import Manifest, NotFound


def _flat(delta: dict[str, torch.Tensor], params: int) -> torch.Tensor:
    """The first `params` tensors (the parameters: buffers follow them) as one fp64 vector."""
    return torch.cat([t.reshape(-1).double() for t in list(delta.values())[:params]])


def _learner_deltas(ctx: RunContext, m: Manifest) -> dict[str, torch.Tensor] | None:
    """learner -> the sum of its deltas merged by m (fp64, flat); None when one is no longer stored."""
    out: dict[str, torch.Tensor] = {}
    for d in m.merged():
        try:
            header, delta = read_tensors(ctx.store, ctx.keys.delta(d.learner, d.seq), checksum=d.checksum)
        except NotFound:
            return None
        flat = _flat(delta, len(delta) - int(header.meta.get("buffers", 0)))
        out[d.learner] = flat if d.learner not in out else out[d.learner] + flat
    return out


def _cos(a: torch.Tensor, b: torch.Tensor) -> float | None:
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    return None if na == 0.0 or nb == 0.0 else float(torch.dot(a, b)) / (na * nb)


def _update(ctx: RunContext, parent: Manifest | None) -> torch.Tensor | None:
    if parent is None or not parent.update_key:
        return None
    try:
        _, update = read_tensors(ctx.store, parent.update_key, checksum=parent.update_checksum)
    except NotFound:
        return None
    return _flat(update, len(update))


def directions(ctx: RunContext) -> list[dict[str, Any]]:
    """One row per merged learner of every merge of every chain: chain, version, learner, cos_others,
    cos_update."""
    rows: list[dict[str, Any]] = []
    for index, chain in enumerate(chain_contexts(ctx)):
        parent: Manifest | None = None
        for m in manifests(chain):
            deltas = _learner_deltas(chain, m) if m.version > 0 else None
            if deltas:
                update = _update(chain, parent)
                total = sum(deltas.values())
                for learner, delta in deltas.items():
                    others = None if len(deltas) < 2 else _cos(delta, total - delta)
                    along = None if update is None or update.numel() != delta.numel() else _cos(delta, update)
                    rows.append({"chain": index, "version": m.version, "learner": learner,
                                 "cos_others": others, "cos_update": along})
            parent = m
    return rows


def summarize_directions(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cosine: how many, min, p1, p5, median, and `at_or_below_0`: the honest deltas a `cos <= 0` rule
    would reject — it would catch the sign flip of every other one (whose cosine is -cos < 0)."""
    out: dict[str, Any] = {"deltas": len(rows)}
    for name in ("cos_others", "cos_update"):
        values = sorted(r[name] for r in rows if r[name] is not None and math.isfinite(r[name]))

        def q(p: float, values=values) -> float | None:
            return values[min(len(values) - 1, int(p * len(values)))] if values else None

        out[name] = {"n": len(values), "min": values[0] if values else None, "p01": q(0.01), "p05": q(0.05),
                     "median": q(0.5), "at_or_below_0": sum(1 for v in values if v <= 0.0)}
    return out

"""Learner lanes: ship-and-carry per fragment. Each fragment has its own base version, global, reference,
seq and unshipped steps/tokens, and ships on its own staggered schedule (fragment p at step p*H/P + k*H).

Contract (DESIGN §5, per fragment): for every fragment, shipped + carried = all local progress on its
tensors. Shipping p: delta = r_p - theta_p, r_p -= dequantize(delta). Installing p at G_p:
theta_p = G_p + (theta_p - r_p) (carry) or G_p (overwrite), r_p = G_p. Pure tensors: no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.training.fragments import due_offset, put_, take
from diloco.training.tensors import Tensors, add_, clone


@dataclass
class Lane:
    index: int
    fragment: dict
    base: int = -1
    seq: int = 0  # the next delta's seq in this fragment's chain
    glob: Tensors = field(default_factory=dict)
    ref: Tensors = field(default_factory=dict)
    steps: int = 0  # unshipped steps and tokens in r_p - theta_p
    tokens: int = 0
    shipped_at: int = -(1 << 62)  # the learner step of the last ship (tau counts from it)


class Lanes:
    """The P lanes of one learner. `offset(p)` = p*H/P; `H` = inner.steps_per_phase; `tau` = overlap_steps."""

    def __init__(self, fragments: list[dict], steps_per_phase: int, tau: int, mode: str = "carry") -> None:
        self.lanes = [Lane(i, f) for i, f in enumerate(fragments)]
        self.steps_per_phase, self.tau, self.mode = steps_per_phase, tau, mode

    def __len__(self) -> int:
        return len(self.lanes)

    def join(self, index: int, version: int, glob: Tensors, next_seq: int, theta: Tensors) -> None:
        """Lane `index` starts at `version`: theta_p = r_p = G_p, nothing unshipped."""
        lane = self.lanes[index]
        lane.base, lane.seq, lane.glob, lane.ref = version, next_seq, glob, clone(glob)
        lane.steps = lane.tokens = 0
        put_(theta, lane.fragment, glob)

    def stepped(self, tokens: int) -> None:
        """One inner step: its progress is unshipped in every lane."""
        for lane in self.lanes:
            lane.steps += 1
            lane.tokens += tokens

    def due(self, step: int) -> list[int]:
        """The lanes to ship after learner step `step` (1-based steps since join): p when step = offset(p) mod H."""
        count, h = len(self.lanes), self.steps_per_phase
        return [lane.index for lane in self.lanes
                if lane.steps > 0 and step % h == due_offset(lane.index, count, h) % h]

    def delta(self, index: int, theta: Tensors) -> Tensors:
        """r_p - theta_p: what lane `index` ships now."""
        lane = self.lanes[index]
        part = take(theta, lane.fragment, copy=False)
        return {k: lane.ref[k] - part[k].to("cpu", torch.float32) for k in lane.ref}

    def shipped(self, index: int, dequantized: Tensors, step: int) -> tuple[int, int, int]:
        """The delta went out as `dequantized`: r_p -= it (error feedback); returns (seq, steps, tokens) shipped."""
        lane = self.lanes[index]
        add_(lane.ref, dequantized, alpha=-1.0)
        out = (lane.seq, lane.steps, lane.tokens)
        lane.seq += 1
        lane.steps = lane.tokens = 0
        lane.shipped_at = step
        return out

    def may_install(self, index: int, step: int) -> bool:
        """tau steps after a ship, not before: the overlap a fragment's merge has to arrive in."""
        return step - self.lanes[index].shipped_at >= self.tau

    def install(self, index: int, version: int, glob: Tensors, theta: Tensors) -> None:
        """Move lane `index` to `version` in `theta` (whole-model tensors, e.g. the model's own parameters,
        on any device; written in place): carry the unshipped."""
        lane = self.lanes[index]
        if self.mode == "overwrite":
            new = clone(glob)
        else:
            part = take(theta, lane.fragment, copy=False)
            new = {k: glob[k] + (part[k].to("cpu", torch.float32) - lane.ref[k]) for k in glob}
        put_(theta, lane.fragment, new)
        lane.base, lane.glob, lane.ref = version, glob, clone(glob)

    def version(self) -> int:
        """The learner's version: the oldest fragment it holds."""
        return min(lane.base for lane in self.lanes)

    def meta(self) -> dict:
        return {"bases": [lane.base for lane in self.lanes], "seqs": [lane.seq for lane in self.lanes]}

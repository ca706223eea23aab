"""Learner lanes: ship-and-carry per chain. Each lane has its own base version, global, reference, seq and
unshipped steps/tokens (a LearnerState), and with fragments ships on its own staggered schedule (fragment p at
step p*H/P + k*H). The whole model is one lane holding every tensor whole.

Contract (DESIGN §5, per fragment): for every fragment, shipped + carried = all local progress on its
tensors. Shipping p: delta = r_p - theta_p, r_p -= dequantize(delta). Installing p at G_p:
theta_p = G_p + (theta_p - r_p) (carry) or G_p (overwrite), r_p = G_p. Every step runs tensor by tensor, so
no whole-model copy is ever held beside theta.
Where the tensors live: G_p is a spill file on the learner's own disk (diloco.learner.spill: read one tensor
at a time, never held whole in memory); r_p is one too on a CPU learner (right after an install it *is* G_p's
file, and each ship writes a new one), and lives on theta's device in fp32 on an accelerator (a GPU learner's
ship and carry arithmetic runs there: one transfer of the delta out, one of G_p in). Every delta is fp32 CPU
tensors. Each step is one elementwise fp32 operation, so the bits are the same on any device and in any of
these homes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from diloco.learner.spill import SpillDir, Spilled, scratch_dir
from diloco.learner.state import LearnerState
from diloco.training.fragments import due_offset, put_, take
from diloco.training.tensors import Tensors

Values = Mapping[str, torch.Tensor]  # a dict of tensors, or a Spilled (read one tensor at a time)


@dataclass
class Lane(LearnerState):
    """One chain's LearnerState, the fragment it holds, and the learner step of its last ship."""

    index: int = 0
    fragment: dict = field(default_factory=dict)
    shipped_at: int = -(1 << 62)  # the learner step of the last ship (tau counts from it)

    @property
    def steps(self) -> int:
        """The unshipped steps in r_p - theta_p (steps_since_publish)."""
        return self.steps_since_publish

    @steps.setter
    def steps(self, value: int) -> None:
        self.steps_since_publish = value

    @property
    def tokens(self) -> int:
        """The tokens of the unshipped steps (tokens_since_publish)."""
        return self.tokens_since_publish

    @tokens.setter
    def tokens(self, value: int) -> None:
        self.tokens_since_publish = value


class Lanes:
    """The P lanes of one learner. `offset(p)` = p*H/P; `H` = inner.steps_per_phase; `tau` = overlap_steps."""

    def __init__(self, fragments: list[dict], steps_per_phase: int, tau: int, mode: str = "carry",
                 spill: SpillDir | None = None) -> None:
        self.lanes = [Lane(index=i, fragment=f, merged=-1) for i, f in enumerate(fragments)]
        self.steps_per_phase, self.tau, self.mode = steps_per_phase, tau, mode
        self.shift = 0  # the schedule's place: lane p ships when (step + shift) % H = p*H/P (retime moves it)
        # where G_p (and a CPU learner's r_p) are spilled: the learner's local state dir, or scratch space
        self.spill = spill or SpillDir(scratch_dir(), persist=False)

    def spilled(self, tensors: Values, tag: str = "g") -> Spilled:
        """`tensors` as a spill file (itself when it is one)."""
        return tensors if isinstance(tensors, Spilled) else self.spill.write(tensors.items(), tag=tag)

    def _reference(self, glob: Spilled, device: torch.device, given: Values | None = None) -> Values:
        """r_p = `given` (default G_p): on a CPU learner a spill file (G_p's own when it is G_p), else fp32
        copies on `device`."""
        given = glob if given is None else given
        if device.type == "cpu":
            return glob if given is glob else self.spilled(given, "r")
        return {k: given[k].to(device=device, dtype=torch.float32, copy=True) for k in given}

    def __len__(self) -> int:
        return len(self.lanes)

    def join(self, index: int, version: int, glob: Tensors, next_seq: int, theta: Tensors,
             merged: int = -1) -> None:
        """Lane `index` starts at `version` (`merged`: the learner's cursor in it): theta_p = r_p = G_p,
        nothing unshipped."""
        lane = self.lanes[index]
        lane.glob = self.spilled(glob)
        lane.base, lane.seq, lane.ref = version, next_seq, self._reference(lane.glob, _device(theta))
        lane.merged = merged
        lane.steps = lane.tokens = 0
        put_(theta, lane.fragment, lane.glob)

    def adopt(self, index: int, state: LearnerState, device: torch.device) -> None:
        """Lane `index` takes a resumed chain state (theta is set apart): r_p on `device`."""
        lane = self.lanes[index]
        lane.base, lane.seq, lane.glob = state.base, state.seq, self.spilled(state.glob)
        lane.ref = self._reference(lane.glob, device, lane.glob if state.ref is state.glob else state.ref)
        lane.steps, lane.tokens = state.steps_since_publish, state.tokens_since_publish
        lane.merged = state.merged

    def stepped(self, tokens: int) -> None:
        """One inner step: its progress is unshipped in every lane."""
        for lane in self.lanes:
            lane.steps += 1
            lane.tokens += tokens

    def due(self, step: int) -> list[int]:
        """The lanes to ship after learner step `step` (1-based steps since join): p when step + shift =
        offset(p) mod H."""
        count, h = len(self.lanes), self.steps_per_phase
        return [lane.index for lane in self.lanes
                if lane.steps > 0 and (step + self.shift) % h == due_offset(lane.index, count, h) % h]

    def retime(self, steps_per_phase: int, step: int) -> None:
        """H = `steps_per_phase` from learner step `step` on (inner.dylu): the schedule keeps its place in the
        cycle, scaled (a learner 40% into its cycle goes on 40% into the new one, so a cohort's ships stay
        together in wall time). Only when lanes ship changes: every lane's unshipped progress ships at its
        next due step."""
        old = self.steps_per_phase
        place = (step + self.shift) % old * steps_per_phase // old
        self.shift = (place - step) % steps_per_phase
        self.steps_per_phase = steps_per_phase

    def delta(self, index: int, theta: Tensors) -> Tensors:
        """r_p - theta_p: what lane `index` ships now."""
        lane = self.lanes[index]
        part = take(theta, lane.fragment, copy=False)
        return _to_host({k: lane.ref[k] - part[k].float() for k in lane.ref})

    def take(self, index: int, step: int) -> tuple[int, int, int]:
        """The delta r_p - theta_p just read ships as the next seq: (seq, steps, tokens) it holds; nothing is
        unshipped from here. Its error feedback must follow (feedback) before r_p is read again."""
        lane = self.lanes[index]
        out = (lane.seq, lane.steps, lane.tokens)
        lane.seq += 1
        lane.steps = lane.tokens = 0
        lane.shipped_at = step
        return out

    def feedback(self, index: int, dequantized: Values) -> None:
        """The delta taken went out as `dequantized`: r_p -= it (error feedback), tensor by tensor (a spilled
        r_p: into a new file)."""
        lane = self.lanes[index]
        if isinstance(lane.ref, Spilled):
            ref = lane.ref
            lane.ref = self.spill.write(((k, ref[k].add_(dequantized[k], alpha=-1.0)) for k in ref), tag="r")
            return
        device = _device(lane.ref)
        for k, v in lane.ref.items():
            v.add_(dequantized[k].to(device=device), alpha=-1.0)

    def may_install(self, index: int, step: int) -> bool:
        """tau steps after a ship, not before: the overlap a fragment's merge has to arrive in."""
        return step - self.lanes[index].shipped_at >= self.tau

    def install(self, index: int, version: int, glob: Values, theta: Tensors,
                merged: int | None = None) -> None:
        """Move lane `index` to `version` in `theta` (whole-model tensors, e.g. the model's own parameters,
        on any device; written in place): carry the unshipped, tensor by tensor. `merged`: the learner's
        cursor in `version`."""
        lane, device = self.lanes[index], _device(theta)
        glob = self.spilled(glob)
        part = take(theta, lane.fragment, copy=False)
        ref: Values = glob if device.type == "cpu" else {}
        for k in glob:
            g = glob[k].to(device=device, dtype=torch.float32)  # r_p = G_p (on an accelerator, kept as r_p)
            new = g if self.mode == "overwrite" else g + (part[k].float() - lane.ref[k])
            part[k].copy_(new)
            if device.type != "cpu":
                ref[k] = g
            del new
        lane.base, lane.glob, lane.ref = version, glob, ref
        if merged is not None:
            lane.merged = merged

    def version(self) -> int:
        """The learner's version: the oldest fragment it holds."""
        return min(lane.base for lane in self.lanes)

    def meta(self) -> dict:
        return {"bases": [lane.base for lane in self.lanes], "seqs": [lane.seq for lane in self.lanes]}


def _device(tensors: Values) -> torch.device:
    if not tensors or isinstance(tensors, Spilled):
        return torch.device("cpu")
    return next(iter(tensors.values())).device


def _to_host(tensors: Tensors) -> Tensors:
    """fp32 CPU tensors: as they are on the CPU; from an accelerator one transfer of all of them (pinned),
    split."""
    if not tensors or _device(tensors).type == "cpu":
        return tensors
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1) for t in tensors.values()])
        host = torch.empty(flat.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(flat)
    out, offset = {}, 0
    for k, t in tensors.items():
        out[k] = host[offset:offset + t.numel()].view(t.shape).clone()
        offset += t.numel()
    return out

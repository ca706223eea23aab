"""Judging one delta from its stored bytes: size, signature, codec, validation, then the outlier rule.

Contract: `Judge.judge(learner, seq, size, data, signature)` is a pure function of its inputs, the live
config, the guard state and the parent's params — the merger and `audit` call it on the same stored objects
and get the same decision, reason and norm; it never raises on a bad delta (every failure is a rejection with
a reason); a clipped delta is scaled in place and recorded with its scale. The buffers a delta carries are
checked against the chain's (`buffers`, run.json's) and kept out of the norm, the outlier rule and the clip; a
merged delta is handed back with them after its parameters (LearnerGroup takes them off). With a `worker`
(the merger's second thread) each tensor's fp64 sum of squares is computed there while the next one is
decoded, and summed in the delta's order: the same norm, bit for bit, as `delta_norm`. A run's trust rules
say how each tensor's sum of squares is taken (`chunked_norms`, rules 4: a chunk at a time; before: whole),
and audit replays a run's merges by its own rules.
"""

from __future__ import annotations

import math
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.configs import Config
from diloco.run.objects import decode_tensors
from diloco.storage import DeltaDecision
from diloco.storage.codec import CodecError, Header, check_fingerprint, object_checksum, read_header
from diloco.storage.codec.lazy import LazyObject
from diloco.training.fp64 import Fp64Scratch, sum_squares, sum_squares_chunked
from diloco.training.tensors import Tensors, to_torch
from diloco.trust.guard import Policy, window_median
from diloco.trust.signing import verify
from diloco.trust.validate import (
    NON_FINITE,
    DeltaInvalid,
    DeltaStale,
    check_tensors,
    delta_size_bound,
    split_buffers,
    validate_delta,
)


def delta_norm(delta: Tensors, scratch: Fp64Scratch | None = None,
               squares: dict[str, Future] | None = None, chunked: bool = False) -> float:
    """The L2 norm over every tensor, in fp64, in the delta's order (deterministic with one torch thread):
    the sum of `(value.double() ** 2).sum()` (`chunked`: of `sum_squares_chunked(value)`, a chunk at a time),
    squared through `scratch` (a fresh one when None), or taken from `squares` (each tensor's, computed by a
    worker thread with the same function) — the same bits.

    For fp32 values (all the codec decodes) it is finite exactly when every value is: a finite fp32 squared
    is below 1.2e77, so no sum of them overflows fp64, while a NaN or an Inf makes the sum NaN or Inf."""
    scratch, square = scratch or Fp64Scratch(), squares_of(chunked)
    total = torch.zeros((), dtype=torch.float64)
    for name, value in delta.items():
        total += square(value, scratch) if squares is None else squares[name].result()
    return float(torch.sqrt(total))


def squares_of(chunked: bool):
    """The sum of squares a norm takes of each tensor: a chunk at a time (trust rules 4), or whole."""
    return sum_squares_chunked if chunked else sum_squares


@dataclass
class Judge:
    """The judgement of the deltas of one merge on top of `version` (params = that version's)."""

    run_id: str
    fingerprint: str
    version: int
    params: Tensors
    policy: Policy
    keyring: dict[str, list[bytes]] | None = None  # None: signatures not checked (audit without keys)
    # the norms' fp64 squares, reused delta by delta
    scratch: Fp64Scratch = field(default_factory=Fp64Scratch)
    # the buffers every delta of this chain carries (run.json's)
    buffers: list[dict] = field(default_factory=list)
    # trust rules 3 (storage/window.py): the outlier rule's figures go to the decision's `detail`, kept with
    # the window, and its `reason` says what happened without them (a learner reads reasons: they must not
    # tell the bound)
    apart: bool = False
    # a second thread for the norms' squares (they run there, in turn, beside the decoding): the scratch is
    # then the worker's alone; None: computed here, after the decoding
    worker: Executor | None = None
    gate: Any = None  # with a worker: wait(i) before decoding tensor i (merger/decide.FoldGate); None: none
    # each tensor's sum of squares a chunk at a time (RunContext.chunked_norms: trust rules 4); False: whole
    chunked_norms: bool = False
    # with a worker: buffers to decode into, by tensor name (merger/decide.Recycler: `take(name)`, an array
    # or None); None: every tensor decoded into a fresh array
    reuse: Any = None
    _bound: int | None = field(default=None, repr=False)  # delta_size_bound, computed once

    @property
    def cfg(self) -> Config:
        return self.policy.cfg

    @property
    def max_bytes(self) -> int:
        """The largest delta object this merge reads: merger.max_delta_bytes, or the layout's bound when
        unset."""
        limit = self.cfg.merger.max_delta_bytes
        if limit is None:
            if self._bound is None:
                self._bound = delta_size_bound(self.params, self.buffers)
            limit = self._bound
        return limit

    def median(self) -> float | None:
        return None if self.cfg.merger.outlier_rule == "off" else window_median(self.policy.state, self.cfg)

    def judge(self, learner: str, seq: int, size: int, data: bytes | None,
              signature: bytes | None = None) -> tuple[DeltaDecision, Header | None, Tensors | None]:
        """(decision, header, delta): header and delta only when merged."""
        d = DeltaDecision(learner=learner, seq=seq, status="rejected")
        limit = self.max_bytes
        if size > limit or data is None:
            what = ("max_delta_bytes" if self.cfg.merger.max_delta_bytes is not None
                    else "the model's largest delta")
            return self._reject(d, "size", f"oversized: {size} bytes > {what} {limit}")
        d.bytes = len(data)
        if self.worker is None:
            d.checksum = object_checksum(data)
            return self._judge_read(d, learner, seq, data, signature, limit)
        checksum = self.worker.submit(object_checksum, data)  # hashed there while this thread decodes
        try:
            return self._judge_read(d, learner, seq, data, signature, limit)
        finally:
            d.checksum = checksum.result()

    def _judge_read(self, d: DeltaDecision, learner: str, seq: int, data: bytes, signature: bytes | None,
                    limit: int) -> tuple[DeltaDecision, Header | None, Tensors | None]:
        """judge() once the delta's size passed."""
        if self.cfg.learner.sign and self.keyring is not None:
            why = verify(self.keyring.get(learner, []), self.run_id, learner, seq, data, signature)
            if why:
                return self._reject(d, "signature", why)
        try:  # the header first: its tensors must be the model's before a payload byte is decoded
            header = read_header(data, max_bytes=limit)
            check_fingerprint(header, self.fingerprint)
            check_tensors(header, self.params, self.buffers)
            header, delta, squares = self._decoded(data, limit)
            buffers = split_buffers(header, delta, self.buffers)
            staleness = validate_delta(header, delta, learner=learner, seq=seq, version=self.version,
                                       params=self.params, cfg=self.cfg, check_finite=False)
            # finite <=> every value is (fp32): validate's last check
            norm = delta_norm(delta, self.scratch, squares, chunked=self.chunked_norms)
            if not math.isfinite(norm):
                raise DeltaInvalid(NON_FINITE)
        except DeltaStale as err:
            return self._reject(d, "stale", str(err))
        except DeltaInvalid as err:
            return self._reject(d, "invalid", str(err))
        except CodecError as err:
            return self._reject(d, "codec", str(err))
        meta = header.meta
        d.status, d.base_version, d.staleness = "merged", meta["base_version"], staleness
        d.tokens, d.steps = meta["tokens"], meta["steps"]
        d.norm = norm
        decided = self._outlier(d, header, delta)
        if decided[2] is not None:
            decided[2].update(buffers)  # after the parameters, as stored: LearnerGroup.add takes them off
        return decided

    def _decoded(self, data: bytes, limit: int) -> tuple[Header, Tensors, dict[str, Future] | None]:
        """(header, delta, squares): decode_tensors' (header, delta); with a worker, each tensor's fp64 sum of
        squares handed to it as soon as the tensor is decoded (None without one)."""
        if self.worker is None:
            return (*decode_tensors(data, fingerprint=self.fingerprint, max_bytes=limit), None)
        obj = LazyObject(data, fingerprint=self.fingerprint, max_bytes=limit)
        delta: Tensors = {}
        squares: dict[str, Future] = {}
        for index, name in enumerate(obj.names()):
            if self.gate is not None:
                self.gate.wait(index)  # the previous delta's tensor `index` folded and freed first
            out = None if self.reuse is None else self.reuse.take(name)
            delta[name] = value = to_torch({name: obj.array(name, out)})[name]
            squares[name] = self.worker.submit(squares_of(self.chunked_norms), value, self.scratch)
        return obj.header, delta, squares

    def _outlier(self, d: DeltaDecision, header: Header, delta: Tensors):
        median, cfg = self.median(), self.cfg.merger
        per_step = d.norm / d.steps
        if median is None or median <= 0.0 or per_step <= cfg.outlier_threshold * median:
            return d, header, delta
        bound = cfg.outlier_threshold * median
        window = min(len(self.policy.state.norms), cfg.outlier_window)
        what = (f"norm per step {per_step:.3g} is {per_step / median:.0f}x the median {median:.3g} of the "
                f"last {window} merged (threshold {cfg.outlier_threshold:g}x)")
        if cfg.outlier_rule == "reject":
            if self.apart:
                d.detail = what
                return self._reject(d, "outlier", "outlier: its norm per step is above the run's bound")
            return self._reject(d, "outlier", f"outlier: {what}")
        scale = bound / per_step
        for value in delta.values():
            value.mul_(scale)
        d.clip_scale, d.check = scale, "outlier"
        if self.apart:
            d.reason, d.detail = "clipped to the run's bound", f"{what}; scaled by {scale:.3g}"
        else:
            d.reason = f"clipped: {what}; scaled by {scale:.3g}"
        return d, header, delta

    @staticmethod
    def _reject(d: DeltaDecision, check: str, reason: str) -> tuple[DeltaDecision, None, None]:
        d.status, d.check, d.reason = "rejected", check, reason[:500]
        return d, None, None

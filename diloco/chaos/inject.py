"""Hostile deltas: corrupt, truncated, duplicated, NaN, oversized, stale, and a seq that goes backwards.

Contract: each is written under a dedicated chaos learner name (never a live learner's next seq,
which would fence it), admitted to the run first (an operator's `admit` op, by "chaos"), with a
correct-looking header where the variant needs one; valid-looking filler deltas are zeros with 1 token and 1
step, so a merge that takes one barely moves the model.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from diloco.inspect.model_out import version_params
from diloco.run.context import RunContext
from diloco.run.controls import membership, write_op
from diloco.run.objects import encode_tensors
from diloco.storage import latest_version
from diloco.storage.keys import parse_delta_key
from diloco.training.tensors import Tensors, clone
from diloco.trust.validate import delta_size_bound

MAX_OVERSIZED_BYTES = 64 << 20  # above this max_delta_bytes, "oversized" is a wrong-layout delta instead


class Injector:
    """Builds and writes the hostile objects of one run; keeps the next seq of each chaos learner."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        _, params = version_params(ctx, 0)  # the run's layout from version 0's tensors: no user code needed
        self.zeros = {k: torch.zeros_like(v) for k, v in params.items()}
        self.next_seq: dict[str, int] = {}
        self.admitted: set[str] = set()

    def _seq(self, learner: str) -> int:
        if learner not in self.next_seq:
            listed = [parse_delta_key(k) for k in self.ctx.store.list(self.ctx.keys.deltas_prefix(learner))]
            self.next_seq[learner] = max([p[1] for p in listed if p] + [-1]) + 1
        return self.next_seq[learner]

    def encode(self, learner: str, seq: int, base: int, tensors: Tensors | None = None) -> bytes:
        meta = {"learner": learner, "seq": seq, "base_version": base, "tokens": 1, "steps": 1,
                "phase_time_s": 0.0, "train_loss": 0.0, "created_at": time.time(), "chaos": True}
        return encode_tensors(tensors if tensors is not None else self.zeros, codec_name="fp32", kind="delta",
                                fingerprint=self.ctx.fingerprint, meta=meta, shuffle=False)

    def admit(self, learner: str) -> None:
        """The chaos writers are admitted learners (their deltas meet the codec and validation, not just the
        admission check); once per name and run."""
        if learner in self.admitted:
            return
        if learner not in membership(self.ctx.store, self.ctx.keys, self.ctx.learners).members:
            write_op(self.ctx.store, self.ctx.keys, "admit", learner=learner, by="chaos",
                     values={"start": False},
                     reason="a chaos writer of hostile deltas (no supervisor starts it)")
        self.admitted.add(learner)

    def write(self, learner: str, seq: int, data: bytes) -> str:
        self.admit(learner)
        key = self.ctx.keys.delta(learner, seq)
        self.ctx.store.put_if_absent(key, data)
        self.next_seq[learner] = max(self.next_seq.get(learner, 0), seq + 1)
        return key

    def bad_delta(self, variant: str, learner: str, version: int) -> tuple[str, str] | None:
        """Write one hostile delta; (key, expected rejection) or None when it cannot be made yet."""
        seq = self._seq(learner)
        # based on the newest version when written, not the one the agent saw: under load the agent's view
        # lags, and a delta made stale by that lag would be rejected as stale before its own defect is looked
        # at
        newest = latest_version(self.ctx.store, self.ctx.keys)
        data, why = self._make(variant, learner, seq, max(version, newest or 0))
        if data is None:
            return None
        return self.write(learner, seq, data), why

    def _make(self, variant: str, learner: str, seq: int, version: int) -> tuple[bytes | None, str]:
        cfg = self.ctx.cfg
        if variant == "corrupt":
            data = bytearray(self.encode(learner, seq, version))
            for i in range(len(data) - 64, len(data) - 32):
                data[i] ^= 0xFF
            return bytes(data), "checksum"
        if variant == "truncated":
            data = self.encode(learner, seq, version)
            return data[: len(data) // 2], "truncated"
        if variant == "duplicated":
            return self._copy_of_live(), "header names another learner/seq"
        if variant == "nan":
            tensors = clone(self.zeros)
            next(iter(tensors.values())).view(-1)[0] = float("nan")
            return self.encode(learner, seq, version, tensors), "non-finite"
        if variant == "oversized":
            return self._oversized(learner, seq, version), "oversized"
        if variant == "stale":
            base = version - cfg.outer.max_staleness - 1
            return (None, "") if base < 0 else (self.encode(learner, seq, base), "stale")
        raise ValueError(f"unknown bad_delta variant {variant!r}")

    def _copy_of_live(self) -> bytes | None:
        for name in self.ctx.learners:
            keys = self.ctx.store.list(self.ctx.keys.deltas_prefix(name))
            if keys:
                return self.ctx.store.get(keys[-1])  # a replay of a real learner's delta, bytes and all
        return None

    def _oversized(self, learner: str, seq: int, version: int) -> bytes:
        limit = self.ctx.cfg.merger.max_delta_bytes or delta_size_bound(self.zeros, self.ctx.buffers)
        n = limit // 4 + 1024 if limit <= MAX_OVERSIZED_BYTES else 1 << 20
        noise = np.random.default_rng(seq).standard_normal(n).astype(np.float32)  # incompressible
        tensors = {**self.zeros, "chaos/pad": torch.from_numpy(noise)}
        return self.encode(learner, seq, version, tensors)

    def seq_backwards(self, learner: str, version: int, stage: int) -> str:
        """Stage 0: publish seq 2 (0 and 1 missing: declared lost). Stage 1: then publish seq 1."""
        seq = 2 if stage == 0 else 1
        return self.write(learner, seq, self.encode(learner, seq, version))

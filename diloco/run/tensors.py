"""Tensor objects in the bucket: torch <-> numpy, and encode/write, read/decode with checks.

Contract: every tensor object is written by the pickle-free codec and read back with size and
fingerprint checks; callers get fp32 CPU torch tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from diloco.storage import codec
from diloco.storage.store import Store

Tensors = dict[str, torch.Tensor]


def to_numpy(tensors: Tensors) -> dict[str, np.ndarray]:
    return {k: v.detach().to("cpu", torch.float32).contiguous().numpy() for k, v in tensors.items()}


def to_torch(arrays: dict[str, np.ndarray]) -> Tensors:
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in arrays.items()}


def encode_tensors(
    tensors: Tensors, *, codec_name: str, kind: str, fingerprint: str,
    meta: dict[str, Any] | None = None, shuffle: bool = True,
) -> bytes:
    return codec.encode(
        to_numpy(tensors), codec=codec_name, kind=kind, fingerprint=fingerprint, meta=meta or {},
        shuffle=shuffle,
    )


def decode_tensors(
    data: bytes, *, fingerprint: str | None = None, max_bytes: int | None = None
) -> tuple[codec.Header, Tensors]:
    header, arrays = codec.decode(data, max_bytes=max_bytes, expected_fingerprint=fingerprint)
    return header, to_torch(arrays)


def write_tensors(
    store: Store, key: str, tensors: Tensors, *, kind: str, fingerprint: str,
    codec_name: str = "fp32", meta: dict[str, Any] | None = None,
) -> tuple[int, str]:
    """Encode and put; returns (size in bytes, object checksum)."""
    data = encode_tensors(tensors, codec_name=codec_name, kind=kind, fingerprint=fingerprint, meta=meta)
    store.put(key, data)
    return len(data), codec.object_checksum(data)


def read_tensors(
    store: Store, key: str, *, fingerprint: str | None = None, checksum: str | None = None,
    max_bytes: int | None = None,
) -> tuple[codec.Header, Tensors]:
    """Get, verify the recorded checksum (when given), decode."""
    data = store.get(key)
    if checksum and codec.object_checksum(data) != checksum:
        raise codec.CodecError(f"{key}: checksum {codec.object_checksum(data)} != recorded {checksum}")
    return decode_tensors(data, fingerprint=fingerprint, max_bytes=max_bytes)


def add_(target: Tensors, other: Tensors, alpha: float = 1.0) -> None:
    for k, v in target.items():
        v.add_(other[k], alpha=alpha)


def sub(a: Tensors, b: Tensors) -> Tensors:
    return {k: a[k] - b[k] for k in a}


def clone(t: Tensors) -> Tensors:
    return {k: v.detach().clone() for k, v in t.items()}


def all_finite(t: Tensors) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in t.values())


def same_layout(a: Tensors, b: Tensors) -> bool:
    return list(a) == list(b) and all(a[k].shape == b[k].shape for k in a)

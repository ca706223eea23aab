"""Tensor objects in the bucket: encode/write and read/decode tensor dicts through the codec, with checks.

Contract: every tensor object is written by the pickle-free codec and read back with size, checksum and
fingerprint checks; callers get fp32 CPU torch tensors.
"""

from __future__ import annotations

from typing import Any

from diloco.storage import codec
from diloco.storage.store import Store
from diloco.training.tensors import Tensors, to_numpy, to_torch


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

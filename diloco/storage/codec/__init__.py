"""The delta codec: a versioned JSON header plus a block-quantized, shuffled payload in lz4 or zstd frames.

Contract: pickle-free; encode(decode(x)) is exact for fp32; decode of a truncated, corrupted,
oversized, wrong-version or hostile object raises CodecError before allocating anything large.
The same container carries deltas, full params, compact updates and outer-optimizer state.

Layout byte by byte, error bounds and refusals: docs/CODEC.md. int8/int4 refuse NaN/Inf (CodecError);
fp32/bf16 carry them so the merger's finiteness check sees them. Here: encode and decode; the header,
its limits and checks in header.py; the per-tensor streams and their frames in payload.py.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from diloco.storage.codec.header import (
    CODECS,
    COMPRESSIONS,
    FORMAT_VERSION,
    MAGIC,
    MAX_NAME_CHARS,
    CodecError,
    Header,
    TensorSpec,
    block_size_of,
    check_encode_args,
    check_tensor_codec,
    codec_of,
    fingerprint_of,
    object_checksum,
    pack_header,
    read_header,
    read_layout,
    rehead,
)
from diloco.storage.codec.lazy import LazyObject
from diloco.storage.codec.payload import (
    decode_stream,
    encode_stream,
    frame_stream,
    zstd_available,
)

__all__ = ["CODECS", "FORMAT_VERSION", "MAGIC", "CodecError", "Encoder", "Header", "TensorSpec",
           "check_fingerprint", "codec_of", "decode",
           "encode", "fingerprint_of", "object_checksum", "read_header", "rehead", "verify"]


def _as_input(name: Any, value: Any) -> np.ndarray:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise CodecError(
            f"tensor names must be non-empty strings of at most {MAX_NAME_CHARS} chars, got {name!r}"
        )
    arr = np.asarray(value)
    if arr.dtype != np.float32:
        raise CodecError(f"tensor {name!r} has dtype {arr.dtype}; the codec takes float32")
    return arr if arr.flags.c_contiguous else arr.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)


class Encoder:
    """encode(), one tensor at a time: `add(name, array)` frames a tensor and hands back its raw stream,
    `shipped(...)` decodes that stream as decode() would (the same bits, without the lz4 round trip),
    `finish()` returns the object's bytes. An added array must not change before finish() (a frame lz4
    cannot shrink is a view of the stream, which for unshuffled fp32 is a view of the array).
    `into_bytearray`: the same bytes, built in one bytearray each frame is appended to as it is made (grown
    in place, the header put in front at the end): the frames are never all held beside the object.
    `compress=False`: every frame stored raw, no lz4 (fp32 state, which lz4 shrinks by about a tenth at a
    cost in time; decode needs nothing to tell: a frame as long as its raw size is raw). Otherwise
    fp32/bf16 frames are lz4 blocks (shuffled planes have runs) and quantized ones zstd frames (their codes
    have no runs, but skewed values: int4 ~3.2 bits of entropy in 4), recorded as the header's
    `compression`; `compression` names it instead (a chain checkpoint's shuffled fp32 parts: zstd takes
    ~1/6 off, lz4 ~1/12)."""

    def __init__(self, *, codec: str, kind: str, fingerprint: str, meta: Mapping[str, Any] | None = None,
                 shuffle: bool = True, block_size: int | None = None, into_bytearray: bool = False,
                 compress: bool = True, compression: str | None = None) -> None:
        block_size = block_size_of(codec, block_size)
        check_encode_args(codec, kind, fingerprint, block_size)
        if meta is not None and not isinstance(meta, Mapping):
            raise CodecError(f"meta must be a mapping, got {type(meta).__name__}")
        self.codec, self.kind, self.fingerprint, self.block_size = codec, kind, fingerprint, block_size
        self.meta = dict(meta or {})
        self.shuffle = bool(shuffle) and codec in ("fp32", "bf16")
        self.compression = None if not compress else compression or ("lz4" if codec in ("fp32", "bf16") or
                                                                      not zstd_available() else "zstd")
        if self.compression not in (None, *COMPRESSIONS):
            raise CodecError(f"compression {compression!r} must be one of {COMPRESSIONS}")
        self.parts: list[Any] = []
        self.out = bytearray() if into_bytearray else None
        self.entries: list[dict[str, Any]] = []
        self.crc = 0

    def add(self, name: Any, value: Any, codec: str | None = None) -> np.ndarray:
        """Frame one tensor; `codec`: its own codec (recorded in its entry), e.g. exact fp32 values in an int4
        delta (a model's buffers); None: the object's. Shuffling applies to an fp32/bf16 tensor when the
        header's `shuffle` does (never in a quantized object)."""
        arr = _as_input(name, value)
        own = (None if codec is None or codec == self.codec
               else check_tensor_codec(codec, self.block_size, name))
        stream = encode_stream(arr.reshape(-1), own or self.codec, self.shuffle, self.block_size, name)
        frames, lengths = frame_stream(stream, self.compression)
        for part in frames:
            self.crc = zlib.crc32(part, self.crc)
            if self.out is not None:
                self.out += part
        if self.out is None:
            self.parts += frames
        entry = {"name": name, "shape": list(arr.shape), "frames": lengths}
        self.entries.append(entry if own is None else {**entry, "codec": own})
        return stream

    def shipped(self, name: str, shape: tuple[int, ...], stream: np.ndarray,
                codec: str | None = None) -> np.ndarray:
        """What decode() gives back for the tensor `add` turned into `stream` (a fresh f32 array)."""
        return decode_stream(stream, codec or self.codec, self.shuffle, self.block_size,
                             TensorSpec(name, tuple(shape)))

    def finish(self) -> bytes | bytearray:
        """The object's bytes (a bytearray when into_bytearray)."""
        fields = {
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "codec": self.codec,
            "block_size": self.block_size,
            "shuffle": self.shuffle,
            "fingerprint": self.fingerprint,
            "meta": self.meta,
            "tensors": self.entries,
            "payload_bytes": sum(sum(e["frames"]) for e in self.entries),
            "payload_crc32": self.crc,
        }
        if self.compression == "zstd":  # absent means lz4: an lz4 object's bytes are unchanged
            fields["compression"] = "zstd"
        header = pack_header(fields)
        if self.out is not None:
            out, self.out = self.out, bytearray()
            out[0:0] = header  # resized in place, the payload moved up
            return out
        parts, self.parts = self.parts, []
        return b"".join([header, *parts])


def encode(
    tensors: Mapping[str, np.ndarray],
    *,
    codec: str,
    kind: str,
    fingerprint: str,
    meta: Mapping[str, Any] | None = None,
    shuffle: bool = True,
    block_size: int | None = None,
    compress: bool = True,
) -> bytes:
    """float32 arrays (in the given order) -> bytes. meta must be JSON-serialisable.

    shuffle applies to fp32/bf16 only (int8/int4/int3/int2 bytes have no planes); the header records the
    effective value. The quantized codecs raise CodecError on NaN/Inf; fp32/bf16 carry them. compress: see
    Encoder.
    """
    encoder = Encoder(codec=codec, kind=kind, fingerprint=fingerprint, meta=meta, shuffle=shuffle,
                      block_size=block_size, compress=compress)
    for name, value in tensors.items():
        encoder.add(name, value)
    return encoder.finish()


def check_fingerprint(header: Header, expected: str | None) -> None:
    """CodecError unless the header's model fingerprint is `expected` (None: anything)."""
    if expected is not None and header.fingerprint != expected:
        raise CodecError(f"fingerprint mismatch: object has {header.fingerprint!r}, expected {expected!r}")


def verify(data: bytes) -> Header:
    """The checks decode() makes before it decodes, and nothing allocated: a valid header, sizes that agree,
    the payload's crc32. CodecError when any fails."""
    layout = read_layout(data, None, allow_partial=False)
    if zlib.crc32(memoryview(data).cast("B")[layout.payload_offset :]) != layout.payload_crc32:
        raise CodecError("payload checksum mismatch: the payload is corrupt")
    return layout.header


def decode(
    data: bytes, *, max_bytes: int | None = None, expected_fingerprint: str | None = None,
    verified: bool = False,
) -> tuple[Header, dict[str, np.ndarray]]:
    """bytes -> (header, float32 arrays). Verifies the checksum and every size before allocating (the checks
    and the decoding are LazyObject's, every tensor at once; `verified`: the caller checked the object's
    recorded checksum, the payload's crc32 is not computed again)."""
    obj = LazyObject(data, fingerprint=expected_fingerprint, max_bytes=max_bytes, verified=verified)
    return obj.header, dict(obj.arrays())

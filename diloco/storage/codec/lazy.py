"""An encoded object decoded one tensor at a time: what a reader that must not hold every tensor at once uses
(a learner folding a compact update into its global tensor by tensor, a checkpoint imported part by part).

Contract: every check before any tensor is decoded (header, sizes, fingerprint, the payload's crc32 — which
a caller that verified the whole object against the checksum a manifest recorded skips: `verified`, the
BLAKE2b over every byte says more), then `array(name)` gives that tensor as a fresh f32 array; codec.decode
is this, every tensor at once.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from diloco.storage.codec.header import CodecError, Header, codec_of, elements_of, read_layout, stream_bytes
from diloco.storage.codec.payload import add_decoded, decode_stream, fits, unframe_stream


class LazyObject:
    """`data` (an encoded object), checked now; tensors decoded on request, by name, in any order."""

    def __init__(self, data: Any, *, fingerprint: str | None = None, max_bytes: int | None = None,
                 verified: bool = False) -> None:
        layout = read_layout(data, max_bytes, allow_partial=False)
        if fingerprint is not None and layout.header.fingerprint != fingerprint:
            raise CodecError(f"fingerprint mismatch: object has {layout.header.fingerprint!r}, "
                             f"expected {fingerprint!r}")
        view = memoryview(data).cast("B")
        self._payload = view[layout.payload_offset:]
        if not verified and zlib.crc32(self._payload) != layout.payload_crc32:
            raise CodecError("payload checksum mismatch: the payload is corrupt")
        self.header: Header = layout.header
        self._where: dict[str, tuple[int, list[int], int]] = {}  # name -> (offset, stored frames, index)
        self._unframed: dict[str, Any] = {}  # name -> (spec, codec, stream), by unframe_all, taken once
        pos = 0
        for index, (spec, stored) in enumerate(zip(self.header.tensors, layout.frames, strict=True)):
            self._where[spec.name] = (pos, stored, index)
            pos += sum(stored)

    def names(self) -> list[str]:
        return [spec.name for spec in self.header.tensors]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def array(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """Tensor `name`, decoded (KeyError when the object has none of that name); into `out` where
        decode_stream can (a block-quantized stream, a buffer that fits), else a fresh array."""
        spec, codec, stream = self._stream(name)
        return decode_stream(stream, codec, self.header.shuffle, self.header.block_size, spec, out)

    def add_to(self, name: str, out: np.ndarray, workers: int = 1) -> None:
        """out += tensor `name` (f32, its shape, contiguous: e.g. a model's tensor's numpy view), decoded a
        chunk at a time (`workers` threads on ranges of it): the bits of `out + array(name)` without the
        decoded array."""
        spec, codec, stream = self._stream(name)
        if not fits(out, elements_of(spec.shape)):
            raise ValueError(f"add_to {name!r}: needs a contiguous f32 array of {list(spec.shape)}")
        add_decoded(stream, codec, self.header.shuffle, self.header.block_size, spec, out, workers)

    def unframe_all(self) -> LazyObject:
        """Decompress every tensor's stream now (e.g. on a read-ahead thread), each used once by `array` or
        `add_to` then dropped, and let go of the object's bytes; returns self."""
        self._unframed = {name: self._stream(name) for name in self._where}
        self._payload = memoryview(b"")  # the object's bytes are not needed again: not held
        return self

    def _stream(self, name: str):
        if name in self._unframed:
            return self._unframed.pop(name)
        pos, stored, index = self._where[name]
        spec = self.header.tensors[index]
        codec = codec_of(self.header, spec)
        raw = stream_bytes(codec, elements_of(spec.shape), self.header.block_size)
        return spec, codec, unframe_stream(self._payload[pos:pos + sum(stored)], stored, raw, spec.name,
                                           self.header.compression)

    def arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every tensor in the object's order, one at a time."""
        for spec in self.header.tensors:
            yield spec.name, self.array(spec.name)

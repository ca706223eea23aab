"""The codec's payload: per-tensor streams (fp32, bf16, block-quantized int8/int4/int3/int2/nf2,
byte-shuffled) and their frames (lz4, zstd or raw).

Contract: encode_stream / decode_stream are exact inverses for fp32 and bounded-error for int8/int4/int3
(half a step per block); int2 and nf2 clip (compact updates: the merger's residual carries the rest);
unframe_stream trusts only frame lengths the header has already validated.
"""

from __future__ import annotations

import functools
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lz4.block
import numpy as np

from diloco.storage.codec.header import (
    FRAME_BYTES,
    MAX_FRAME_RATIO,
    VALUES_PER_BYTE,
    CodecError,
    TensorSpec,
    elements_of,
    frame_sizes,
    stream_bytes,
)

_LEVELS = {"int8": 127, "int4": 7, "int3": 3, "int2": 1, "nf2": 1}
# int2 (ternary) scales a block by 1.5 x its mean |x|, clipping beyond, not by its absmax: on Gaussian values
# that ships 56% of a block's L2 norm instead of 19% (relative error 0.44 against 0.81); ~1.2 sigma is the
# L2-best ternary scale for a Gaussian, and 1.5 x mean |x| is that
TERNARY_SCALE = 1.5
# nf2 spends all four codes of two bits: a mid-rise grid, q = clip(floor(x / s), -2, 1) decoded as
# (q + 1/2) x s, levels +-0.5 s and +-1.5 s, no zero. s = 1.25 x the block's mean |x| is the L2-best step
# of a uniform 4-level grid for Gaussian values (0.996 sigma; sigma = 1.2533 x mean |x|): relative error
# 0.35, against int2's 0.44
NF2_SCALE = 1.25
_SCALE_OF_MEAN = {"int2": TERNARY_SCALE, "nf2": NF2_SCALE}
_CHUNK_ELEMENTS = 1 << 16  # quantize in 256 KiB chunks so temporaries stay in L2
# dequantize 1 MiB of f32 at a time: torch's per-call cost (~5 us) small against the chunk's work, its
# temporaries within the caches (a 124M int4 update added in 0.11 s against 0.19 s with numpy's 64K chunks)
_DEQUANT_CHUNK_ELEMENTS = 1 << 18


# ---------------------------------------------------------------------------------- quantizers


def _quantize_rows(x2: np.ndarray, scales: np.ndarray, out: np.ndarray, codec: str, name: str) -> None:
    """x2 (rows, B) f32 -> scales (rows,) f32 and out: int8 (rows, B) or int4 packed (rows, B/2)."""
    rows, bsz = x2.shape
    levels = _LEVELS[codec]
    step = max(1, _CHUNK_ELEMENTS // bsz)
    t = np.empty((min(step, rows), bsz), np.float32)  # (R, B) scratch, stays in cache
    amax = np.empty(min(step, rows), np.float32)
    inv = np.empty((min(step, rows), 1), np.float32)
    q8 = np.empty((min(step, rows), bsz), np.int8) if codec != "int8" else None
    for s in range(0, rows, step):
        e = min(rows, s + step)
        xs, ts, am, iv = x2[s:e], t[: e - s], amax[: e - s], inv[: e - s]
        np.abs(xs, out=ts)
        np.max(ts, axis=1, out=am)
        if not np.isfinite(am).all():
            raise CodecError(f"non-finite values in tensor {name!r}: {codec} cannot carry NaN/Inf")
        if codec in _SCALE_OF_MEAN:
            np.mean(ts, axis=1, out=am)
            am *= _SCALE_OF_MEAN[codec]
        np.divide(levels, am[:, None], out=iv, where=am[:, None] > 0)
        iv[am == 0] = 0.0
        np.multiply(xs, iv, out=ts)
        if codec == "nf2":
            np.floor(ts, out=ts)
            np.clip(ts, -2.0, 1.0, out=ts)  # an all-zero block: q = 0, and its scale 0 decodes it to 0
        else:
            np.rint(ts, out=ts)  # |ts| <= levels (int8, int4, int3: the scale is the absmax)
        if codec == "int2":
            np.clip(ts, -1.0, 1.0, out=ts)
        np.multiply(am, 1.0 / levels, out=scales[s:e])
        if q8 is None:
            np.copyto(out[s:e], ts, casting="unsafe")
        else:
            _pack(ts, q8[: e - s], out[s:e], VALUES_PER_BYTE[codec])


def _pack(ts: np.ndarray, q8: np.ndarray, packed: np.ndarray, per_byte: int) -> None:
    """ts (R, B) integral floats -> packed (R, B/per_byte): part k of the block (B/per_byte values each) in
    bits k*w .. k*w+w-1 of each byte, w = 8/per_byte, two's complement (int4: low nibble first half, high
    second)."""
    c, bits = ts.shape[1] // per_byte, 8 // per_byte
    np.copyto(q8, ts, casting="unsafe")
    np.bitwise_and(q8, (1 << bits) - 1, out=q8)
    np.copyto(packed, q8[:, :c])
    for k in range(1, per_byte):
        part = q8[:, k * c : (k + 1) * c]
        np.left_shift(part, bits * k, out=part)
        np.bitwise_or(packed, part, out=packed)


def _dequantize_rows(scales: np.ndarray, q: np.ndarray, y2: np.ndarray, codec: str,
                     add: bool = False) -> None:
    """Inverse of _quantize_rows: scales (rows,), q int8 (rows, B) or packed (rows, B/per_byte) -> y2 (f32
    (rows, B), rows may be strided), or y2 += it (`add`). torch's kernels, _DEQUANT_CHUNK_ELEMENTS values at a
    time (numpy's took 1.5-1.7 ns a value, these 0.7-0.8 with the add): the same bits — each value an exact
    int8 -> f32 times its block's scale, one f32 rounding (nf2: plus half the scale, rounded again), then one
    f32 add."""
    rows, bsz = y2.shape
    if rows == 0:
        return
    per_byte = VALUES_PER_BYTE[codec]
    c, bits = bsz // per_byte, 8 // per_byte
    step = max(1, _DEQUANT_CHUNK_ELEMENTS // bsz)
    torch = _torch()
    tq, ts, ty = torch.from_numpy(q), torch.from_numpy(scales), torch.from_numpy(y2)
    part_int = torch.empty((min(step, rows), c), dtype=torch.int8) if per_byte > 1 else None
    product = torch.empty((min(step, rows), c), dtype=torch.float32) if add or codec == "nf2" else None
    for s in range(0, rows, step):
        e = min(rows, s + step)
        p, sc, y = tq[s:e], ts[s:e, None], ty[s:e]
        half = sc * 0.5 if codec == "nf2" else None
        for k in range(per_byte):
            if part_int is None:
                value = p  # int8: the byte is the value
            else:
                value = part_int[: e - s]
                top = 8 - bits * (k + 1)  # part k shifted to the top bits (the last part is there already)
                # arithmetic: sign-extends
                if top:
                    torch.bitwise_left_shift(p, top, out=value)
                    value.bitwise_right_shift_(8 - bits)
                else:
                    torch.bitwise_right_shift(p, 8 - bits, out=value)
            part = y[:, k * c : (k + 1) * c]
            if product is None:
                torch.mul(value, sc, out=part)
                continue
            prod = product[: e - s]
            torch.mul(value, sc, out=prod)
            if half is not None:  # nf2: (q + 1/2) x s
                prod.add_(half)
            if add:
                part.add_(prod)
            else:
                part.copy_(prod)


@functools.cache
def _torch() -> Any:
    """torch, imported on the first dequantization (the storage layer imports none at module level). Its
    warning about a read-only array is filtered, that message only: an object's bytes are read here, never
    written (catch_warnings per call is not thread-safe)."""
    import torch

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
    return torch


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """f32 (n,) -> bf16 bits as u16 (n,), round-to-nearest-even; NaN stays NaN (torch's cast)."""
    import torch  # local: only bf16 needs it, and torch's cast uses the CPU's bf16 instructions

    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _from_bf16(h: np.ndarray) -> np.ndarray:
    """bf16 bits u16 (n,) -> f32 (n,): exact (a bf16 is the top half of an f32)."""
    y = h.astype(np.uint32)
    np.left_shift(y, 16, out=y)
    return y.view(np.float32)


def _shuffle(u8: np.ndarray, width: int) -> np.ndarray:
    """(n*width,) bytes -> byte planes: all first bytes, then all second bytes, ... Always a fresh array: a
    transposing ascontiguousarray returns its input itself when it is one value (a (width, 1) view is already
    contiguous), and a caller that changes the tensor after encoding it would change the stream beneath the
    crc."""
    out = np.empty(u8.size, np.uint8)
    out.reshape(width, -1)[...] = u8.reshape(-1, width).T
    return out


def _unshuffle(u8: np.ndarray, width: int) -> np.ndarray:
    """Byte planes -> (n*width,) bytes: plane k into every width-th byte from k (a plane-wise strided copy,
    some 2.5x faster than a transposing copy of the (width, n) planes; the same bytes)."""
    out = np.empty(u8.size, np.uint8)
    n, rows = u8.size // width, out.reshape(-1, width)
    for k in range(width):
        np.copyto(rows[:, k], u8[k * n : (k + 1) * n])
    return out


def encode_stream(x: np.ndarray, codec: str, shuffle: bool, block_size: int, name: str) -> np.ndarray:
    """One tensor, flat contiguous f32 (n,) -> its raw payload stream (u8)."""
    if codec == "fp32":
        u8 = x.view(np.uint8)
        return _shuffle(u8, 4) if shuffle else u8
    if codec == "bf16":
        u8 = _to_bf16(x).view(np.uint8)
        return _shuffle(u8, 2) if shuffle else u8
    n, bsz = x.size, block_size
    nb, nfull = -(-n // bsz), n // bsz
    stream = np.empty(stream_bytes(codec, n, bsz), np.uint8)
    scales = stream[: 4 * nb].view(np.float32)
    q = stream[4 * nb :].view(np.int8).reshape(nb, bsz // VALUES_PER_BYTE[codec])
    if nfull:
        _quantize_rows(x[: nfull * bsz].reshape(nfull, bsz), scales[:nfull], q[:nfull], codec, name)
    if nb > nfull:  # zero-padded last block
        pad = np.zeros((1, bsz), np.float32)
        pad[0, : n - nfull * bsz] = x[nfull * bsz :]
        _quantize_rows(pad, scales[nfull:], q[nfull:], codec, name)
    return stream


def fits(out: np.ndarray | None, n: int) -> bool:
    """`out` can hold a decoded tensor of n elements in place: f32, n elements, contiguous."""
    return out is not None and out.dtype == np.float32 and out.size == n and out.flags.c_contiguous


def decode_stream(
    stream: np.ndarray, codec: str, shuffle: bool, block_size: int, spec: TensorSpec,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Inverse of encode_stream; returns a writable f32 array of spec.shape: fresh, or for a block-quantized
    stream `out` itself when given and it fits (f32, spec's elements, contiguous; its values overwritten) —
    a caller decoding one object after another into the same buffers spares the fresh pages (~1M page
    faults per decoded 124M-parameter delta)."""
    n, bsz = elements_of(spec.shape), block_size
    # an unshuffled stream unframe_stream just assembled is fresh already: not copied again
    if codec == "fp32":
        y = _unshuffle(stream, 4) if shuffle else stream if stream.flags.owndata else stream.copy()
        return y.view(np.float32).reshape(spec.shape)
    if codec == "bf16":
        h = _unshuffle(stream, 2) if shuffle else stream.copy()
        return _from_bf16(h.view(np.uint16)).reshape(spec.shape)
    scales, q, nfull = _blocks(stream, codec, bsz, spec)
    y = out.reshape(-1) if fits(out, n) else np.empty(n, np.float32)
    if nfull:
        _dequantize_rows(scales[:nfull], q[:nfull], y[: nfull * bsz].reshape(nfull, bsz), codec)
    if len(scales) > nfull:
        pad = np.empty((1, bsz), np.float32)
        _dequantize_rows(scales[nfull:], q[nfull:], pad, codec)
        y[nfull * bsz :] = pad[0, : n - nfull * bsz]
    return y.reshape(spec.shape)


def _blocks(stream: np.ndarray, codec: str, bsz: int, spec: TensorSpec) -> tuple[np.ndarray, np.ndarray, int]:
    """A block-quantized stream's (scales, quantized rows, full blocks), its scales checked."""
    n = elements_of(spec.shape)
    nb, nfull = -(-n // bsz), n // bsz
    scales = stream[: 4 * nb].copy().view(np.float32)  # copy: aligned, and small
    if not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise CodecError(f"tensor {spec.name!r}: block scales must be finite and >= 0")
    return scales, stream[4 * nb :].view(np.int8).reshape(nb, bsz // VALUES_PER_BYTE[codec]), nfull


def add_decoded(stream: np.ndarray, codec: str, shuffle: bool, block_size: int, spec: TensorSpec,
                out: np.ndarray, workers: int = 1) -> None:
    """out (f32, spec's elements, contiguous) += decode_stream(...), the same bits as adding the decoded
    array (f32 + f32, element by element): a block-quantized stream is dequantized a chunk of rows at a time
    into a scratch that stays in cache, never whole (no fresh array, one pass over `out`); `workers` > 1
    splits its rows into that many contiguous ranges, each on its own thread (elementwise: the same bits)."""
    flat = out.reshape(-1)
    if codec in ("fp32", "bf16") or shuffle:
        np.add(flat, decode_stream(stream, codec, shuffle, block_size, spec).reshape(-1), out=flat)
        return
    n, bsz = flat.size, block_size
    scales, q, nfull = _blocks(stream, codec, bsz, spec)
    step = max(1, _DEQUANT_CHUNK_ELEMENTS // bsz)
    rows = flat[: nfull * bsz].reshape(nfull, bsz)
    ranges = max(1, min(workers, nfull // step))  # a range is at least one chunk
    bounds = [nfull * i // ranges for i in range(ranges + 1)]

    def add_rows(first: int, last: int) -> None:
        _dequantize_rows(scales[first:last], q[first:last], rows[first:last], codec, add=True)

    if ranges == 1:
        add_rows(0, nfull)
    else:
        with ThreadPoolExecutor(max_workers=ranges - 1, thread_name_prefix="add-decoded") as pool:
            others = [pool.submit(add_rows, a, b) for a, b in zip(bounds[1:-1], bounds[2:], strict=True)]
            add_rows(bounds[0], bounds[1])
            for done in others:
                done.result()
    if len(scales) > nfull:
        pad = np.empty((1, bsz), np.float32)
        _dequantize_rows(scales[nfull:], q[nfull:], pad, codec)
        tail = flat[nfull * bsz :]
        np.add(tail, pad[0, : n - nfull * bsz], out=tail)


# ------------------------------------------------------------------------------------- framing


_ZSTD_SKIPPABLE = struct.Struct("<II")  # a zstd skippable frame: magic, then the length of what follows
_ZSTD_SKIPPABLE_MAGIC = 0x184D2A50


@functools.cache
def zstd_available() -> bool:
    import pyarrow as pa

    return bool(pa.Codec.is_available("zstd"))


@functools.cache
def _zstd():
    """pyarrow's zstd (a dependency already: parquet corpora); imported on first use (~0.1 s)."""
    import pyarrow as pa

    if not zstd_available():
        raise CodecError("this pyarrow build has no zstd: it cannot read zstd frames")
    return pa.Codec("zstd", compression_level=1)


@functools.cache
def _pool():
    """The C allocator for zstd's buffers (copied into bytes at once): pyarrow's default pool (mimalloc) keeps
    what it freed, measured 0.7x a 50 MB model's bytes resident in a learner after encoding one int4 delta."""
    import pyarrow as pa

    return pa.system_memory_pool()


def _compress_frame(raw: memoryview, compression: str | None) -> Any:
    if compression == "lz4":
        return lz4.block.compress(raw, store_size=False)
    if compression == "zstd":
        packed = _zstd().compress(raw, asbytes=True, memory_pool=_pool())
        # decode refuses a frame claiming more than MAX_FRAME_RATIO x expansion (a bound on what a small
        # object can make a reader allocate); zstd shrinks a block of zeros far more, so such a frame is
        # padded up to the bound with a zstd skippable frame, which decompression passes over: lz4's best
        # ratio, no better
        short = -(-(len(raw) - 64) // MAX_FRAME_RATIO) - len(packed)
        if short > 0:
            pad = max(0, short - _ZSTD_SKIPPABLE.size)
            packed += _ZSTD_SKIPPABLE.pack(_ZSTD_SKIPPABLE_MAGIC, pad) + bytes(pad)
        return packed
    return raw


def frame_stream(stream: np.ndarray, compression: str | None = "lz4") -> tuple[list[Any], list[int]]:
    """Raw stream -> (frame buffers, stored lengths). A frame the compression cannot shrink is stored raw,
    and so is every frame when `compression` is None (decode tells them apart by length: a frame as long as
    its raw size is raw; a shorter one is compressed with the object's `compression`)."""
    view = memoryview(stream).cast("B")
    parts, lengths = [], []
    for start in range(0, len(view), FRAME_BYTES):
        raw = view[start : start + FRAME_BYTES]
        packed = _compress_frame(raw, compression)
        part = packed if len(packed) < len(raw) else raw
        parts.append(part)
        lengths.append(len(part))
    return parts, lengths


def _decompress_frame(frame: memoryview, size: int, compression: str, name: str, i: int) -> Any:
    if compression == "zstd":
        try:
            return _zstd().decompress(frame, decompressed_size=size, asbytes=True, memory_pool=_pool())
        except OSError as exc:  # pyarrow's ArrowIOError: corrupt, truncated, or not that many bytes
            raise CodecError(f"tensor {name!r}: zstd frame {i} is corrupt ({exc})") from None
    try:
        return lz4.block.decompress(frame, uncompressed_size=size)
    except lz4.block.LZ4BlockError as exc:
        raise CodecError(f"tensor {name!r}: lz4 frame {i} is corrupt ({exc})") from None


def unframe_stream(view: memoryview, stored: list[int], raw_bytes: int, name: str,
                   compression: str = "lz4") -> np.ndarray:
    """Stored frames (lengths already validated against the header) -> the raw stream (u8)."""
    sizes = frame_sizes(raw_bytes)
    out = np.empty(raw_bytes, np.uint8) if len(sizes) > 1 else None
    pos = 0
    for i, (length, size) in enumerate(zip(stored, sizes, strict=True)):
        frame = view[pos : pos + length]
        pos += length
        if length < size:
            frame = _decompress_frame(frame, size, compression, name, i)
            if len(frame) != size:
                raise CodecError(f"tensor {name!r}: {compression} frame {i} holds {len(frame)} bytes, "
                                 f"expected {size}")
        if out is None:
            return np.frombuffer(frame, np.uint8)
        out[i * FRAME_BYTES : i * FRAME_BYTES + size] = np.frombuffer(frame, np.uint8)
    return out if out is not None else np.empty(0, np.uint8)

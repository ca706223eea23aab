"""The delta codec: a versioned JSON header plus a block-quantized, shuffled, lz4-framed payload.

Contract: pickle-free; encode(decode(x)) is exact for fp32; decode of a truncated, corrupted,
oversized, wrong-version or hostile object raises CodecError before allocating anything large.
The same container carries deltas, full params, compact updates and outer-optimizer state.

Layout byte by byte, error bounds and refusals: docs/CODEC.md. int8/int4 refuse NaN/Inf (CodecError);
fp32/bf16 carry them so the merger's finiteness check sees them.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lz4.block
import numpy as np

CODECS = ("fp32", "bf16", "int8", "int4")
FORMAT_VERSION = 1
MAGIC = b"DLCO"

# Limits a header must respect; anything beyond is refused before allocating.
PREFIX = struct.Struct("<4sHHII")  # magic, format_version, flags, header_len, header_crc32
MAX_HEADER_BYTES = 64 << 20  # 64 MiB of JSON: ~1M tensor entries; real headers are kilobytes
MAX_TENSORS = 1 << 20
MAX_NDIM = 32
MAX_NAME_CHARS = 1024
MAX_ELEMENTS = 1 << 36  # 64 G elements in one object (256 GiB fp32): far beyond any delta
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 2, 1 << 20
FRAME_BYTES = 1 << 24  # raw bytes per lz4 frame (lz4 blocks top out near 2 GiB)
LZ4_MAX_RATIO = 256  # lz4 cannot expand a block by more than ~255x; bounds claimed raw sizes
_LEVELS = {"int8": 127, "int4": 7}
_CHUNK_ELEMENTS = 1 << 16  # quantize in 256 KiB chunks so temporaries stay in L2
_KIND_RE = re.compile(r"[a-z0-9_-]{1,32}")
_HEADER_KEYS = {
    "format_version",
    "kind",
    "codec",
    "block_size",
    "shuffle",
    "fingerprint",
    "meta",
    "tensors",
    "payload_bytes",
    "payload_crc32",
}


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
    canon = json.dumps([[str(name), [int(d) for d in shape]] for name, shape in specs], separators=(",", ":"))
    return hashlib.sha256((canon + "\n" + extra).encode()).hexdigest()[:16]


def object_checksum(data: bytes) -> str:
    """The checksum of a whole encoded object, as recorded in manifests (hex string).

    BLAKE2b-128 (~1 GB/s on one core, the same on every CPU): the manifest pins an object's exact
    bytes for audit replay, so it gets a cryptographic hash; the in-object crc32s only catch damage.
    """
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# ---------------------------------------------------------------------------------------- sizes


def _num_elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _stream_bytes(codec: str, n: int, block_size: int) -> int:
    """Raw stream length of one tensor of n elements (exact, from the header alone)."""
    if codec == "fp32":
        return 4 * n
    if codec == "bf16":
        return 2 * n
    nb = -(-n // block_size)
    return 4 * nb + (nb * block_size if codec == "int8" else nb * block_size // 2)


def _frame_sizes(raw_bytes: int) -> list[int]:
    return [min(FRAME_BYTES, raw_bytes - s) for s in range(0, raw_bytes, FRAME_BYTES)]


# ---------------------------------------------------------------------------------- quantizers


def _quantize_rows(x2: np.ndarray, scales: np.ndarray, out: np.ndarray, codec: str, name: str) -> None:
    """x2 (rows, B) f32 -> scales (rows,) f32 and out: int8 (rows, B) or int4 packed (rows, B/2)."""
    rows, bsz = x2.shape
    levels = _LEVELS[codec]
    step = max(1, _CHUNK_ELEMENTS // bsz)
    t = np.empty((min(step, rows), bsz), np.float32)  # (R, B) scratch, stays in cache
    amax = np.empty(min(step, rows), np.float32)
    inv = np.empty((min(step, rows), 1), np.float32)
    q8 = np.empty((min(step, rows), bsz), np.int8) if codec == "int4" else None
    for s in range(0, rows, step):
        e = min(rows, s + step)
        xs, ts, am, iv = x2[s:e], t[: e - s], amax[: e - s], inv[: e - s]
        np.abs(xs, out=ts)
        np.max(ts, axis=1, out=am)
        if not np.isfinite(am).all():
            raise CodecError(f"non-finite values in tensor {name!r}: {codec} cannot carry NaN/Inf")
        np.divide(levels, am[:, None], out=iv, where=am[:, None] > 0)
        iv[am == 0] = 0.0
        np.multiply(xs, iv, out=ts)
        np.rint(ts, out=ts)  # |ts| <= levels: no clipping needed
        np.multiply(am, 1.0 / levels, out=scales[s:e])
        if q8 is None:
            np.copyto(out[s:e], ts, casting="unsafe")
        else:
            _pack_int4(ts, q8[: e - s], out[s:e])


def _pack_int4(ts: np.ndarray, q8: np.ndarray, packed: np.ndarray) -> None:
    """ts (R, B) integral floats in -7..7 -> packed (R, B/2): low nibble first half, high second."""
    h = ts.shape[1] // 2
    np.copyto(q8, ts, casting="unsafe")
    lo, hi = q8[:, :h], q8[:, h:]
    np.left_shift(hi, 4, out=hi)
    np.bitwise_and(lo, 0x0F, out=lo)
    np.bitwise_or(lo, hi, out=packed)


def _dequantize_rows(scales: np.ndarray, q: np.ndarray, y2: np.ndarray, codec: str) -> None:
    """Inverse of _quantize_rows: scales (rows,), q int8 (rows, B) or packed (rows, B/2) -> y2."""
    rows, bsz = y2.shape
    if codec == "int8":
        np.multiply(q, scales[:, None], out=y2)
        return
    h = bsz // 2
    step = max(1, _CHUNK_ELEMENTS // bsz)
    lo = np.empty((min(step, rows), h), np.int8)
    for s in range(0, rows, step):
        e = min(rows, s + step)
        p, ls, sc = q[s:e], lo[: e - s], scales[s:e, None]
        np.left_shift(p, 4, out=ls)
        np.right_shift(ls, 4, out=ls)  # arithmetic: sign-extends the low nibble
        np.multiply(ls, sc, out=y2[s:e, :h])
        np.right_shift(p, 4, out=ls)
        np.multiply(ls, sc, out=y2[s:e, h:])


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
    """(n*width,) bytes -> byte planes: all first bytes, then all second bytes, ..."""
    return np.ascontiguousarray(u8.reshape(-1, width).T).reshape(-1)


def _unshuffle(u8: np.ndarray, width: int) -> np.ndarray:
    return np.ascontiguousarray(u8.reshape(width, -1).T).reshape(-1)


def _encode_stream(x: np.ndarray, codec: str, shuffle: bool, block_size: int, name: str) -> np.ndarray:
    """One tensor, flat contiguous f32 (n,) -> its raw payload stream (u8)."""
    if codec == "fp32":
        u8 = x.view(np.uint8)
        return _shuffle(u8, 4) if shuffle else u8
    if codec == "bf16":
        u8 = _to_bf16(x).view(np.uint8)
        return _shuffle(u8, 2) if shuffle else u8
    n, bsz = x.size, block_size
    nb, nfull = -(-n // bsz), n // bsz
    stream = np.empty(_stream_bytes(codec, n, bsz), np.uint8)
    scales = stream[: 4 * nb].view(np.float32)
    q = stream[4 * nb :].view(np.int8).reshape(nb, bsz if codec == "int8" else bsz // 2)
    if nfull:
        _quantize_rows(x[: nfull * bsz].reshape(nfull, bsz), scales[:nfull], q[:nfull], codec, name)
    if nb > nfull:  # zero-padded last block
        pad = np.zeros((1, bsz), np.float32)
        pad[0, : n - nfull * bsz] = x[nfull * bsz :]
        _quantize_rows(pad, scales[nfull:], q[nfull:], codec, name)
    return stream


def _decode_stream(
    stream: np.ndarray, codec: str, shuffle: bool, block_size: int, spec: TensorSpec
) -> np.ndarray:
    """Inverse of _encode_stream; returns a fresh writable f32 array of spec.shape."""
    n, bsz = _num_elements(spec.shape), block_size
    if codec == "fp32":
        y = _unshuffle(stream, 4) if shuffle else stream.copy()
        return y.view(np.float32).reshape(spec.shape)
    if codec == "bf16":
        h = _unshuffle(stream, 2) if shuffle else stream.copy()
        return _from_bf16(h.view(np.uint16)).reshape(spec.shape)
    nb, nfull = -(-n // bsz), n // bsz
    scales = stream[: 4 * nb].copy().view(np.float32)  # copy: aligned, and small
    if not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise CodecError(f"tensor {spec.name!r}: block scales must be finite and >= 0")
    q = stream[4 * nb :].view(np.int8).reshape(nb, bsz if codec == "int8" else bsz // 2)
    y = np.empty(n, np.float32)
    if nfull:
        _dequantize_rows(scales[:nfull], q[:nfull], y[: nfull * bsz].reshape(nfull, bsz), codec)
    if nb > nfull:
        pad = np.empty((1, bsz), np.float32)
        _dequantize_rows(scales[nfull:], q[nfull:], pad, codec)
        y[nfull * bsz :] = pad[0, : n - nfull * bsz]
    return y.reshape(spec.shape)


# ------------------------------------------------------------------------------------- framing


def _frame(stream: np.ndarray) -> tuple[list[Any], list[int]]:
    """Raw stream -> (frame buffers, stored lengths). A frame lz4 cannot shrink is stored raw."""
    view = memoryview(stream).cast("B")
    parts, lengths = [], []
    for start in range(0, len(view), FRAME_BYTES):
        raw = view[start : start + FRAME_BYTES]
        packed = lz4.block.compress(raw, store_size=False)
        part = packed if len(packed) < len(raw) else raw
        parts.append(part)
        lengths.append(len(part))
    return parts, lengths


def _unframe(view: memoryview, stored: list[int], raw_bytes: int, name: str) -> np.ndarray:
    """Stored frames (lengths already validated against the header) -> the raw stream (u8)."""
    sizes = _frame_sizes(raw_bytes)
    out = np.empty(raw_bytes, np.uint8) if len(sizes) > 1 else None
    pos = 0
    for i, (length, size) in enumerate(zip(stored, sizes, strict=True)):
        frame = view[pos : pos + length]
        pos += length
        if length < size:
            try:
                frame = lz4.block.decompress(frame, uncompressed_size=size)
            except lz4.block.LZ4BlockError as exc:
                raise CodecError(f"tensor {name!r}: lz4 frame {i} is corrupt ({exc})") from None
            if len(frame) != size:
                raise CodecError(f"tensor {name!r}: lz4 frame {i} holds {len(frame)} bytes, expected {size}")
        if out is None:
            return np.frombuffer(frame, np.uint8)
        out[i * FRAME_BYTES : i * FRAME_BYTES + size] = np.frombuffer(frame, np.uint8)
    return out if out is not None else np.empty(0, np.uint8)


# -------------------------------------------------------------------------------------- header


def _check_encode_args(codec: str, kind: str, fingerprint: str, block_size: int) -> None:
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise CodecError(f"kind must match {_KIND_RE.pattern}, got {kind!r}")
    if not isinstance(fingerprint, str) or len(fingerprint) > 256:
        raise CodecError(f"fingerprint must be a string of at most 256 chars, got {fingerprint!r}")
    if type(block_size) is not int or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE or block_size % 2:
        raise CodecError(
            f"block_size must be an even int in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size!r}"
        )


def _as_input(name: Any, value: Any) -> np.ndarray:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise CodecError(
            f"tensor names must be non-empty strings of at most {MAX_NAME_CHARS} chars, got {name!r}"
        )
    arr = np.asarray(value)
    if arr.dtype != np.float32:
        raise CodecError(f"tensor {name!r} has dtype {arr.dtype}; the codec takes float32")
    return arr if arr.flags.c_contiguous else arr.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)


def _pack_header(fields: dict[str, Any]) -> bytes:
    """Header dict -> prefix + JSON (padded so the payload starts 16-aligned)."""
    try:
        text = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise CodecError(f"meta must be JSON-serialisable: {exc}") from None
    text += b" " * (-(PREFIX.size + len(text)) % 16)
    if len(text) > MAX_HEADER_BYTES:
        raise CodecError(f"header of {len(text)} bytes exceeds {MAX_HEADER_BYTES}")
    head = PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(text), 0)[:12]
    crc = zlib.crc32(text, zlib.crc32(head))
    return head + struct.pack("<I", crc) + text


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
    """float32 arrays (in the given order) -> bytes. meta must be JSON-serialisable.

    shuffle applies to fp32/bf16 only (int8/int4 bytes have no planes); the header records the
    effective value. int8/int4 raise CodecError on NaN/Inf; fp32/bf16 carry them.
    """
    _check_encode_args(codec, kind, fingerprint, block_size)
    if meta is not None and not isinstance(meta, Mapping):
        raise CodecError(f"meta must be a mapping, got {type(meta).__name__}")
    shuffle = bool(shuffle) and codec in ("fp32", "bf16")
    parts: list[Any] = []
    entries = []
    crc = 0
    for name, value in tensors.items():
        arr = _as_input(name, value)
        frames, lengths = _frame(_encode_stream(arr.reshape(-1), codec, shuffle, block_size, name))
        for part in frames:
            crc = zlib.crc32(part, crc)
        parts += frames
        entries.append({"name": name, "shape": list(arr.shape), "frames": lengths})
    fields = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "codec": codec,
        "block_size": block_size,
        "shuffle": shuffle,
        "fingerprint": fingerprint,
        "meta": dict(meta or {}),
        "tensors": entries,
        "payload_bytes": sum(sum(e["frames"]) for e in entries),
        "payload_crc32": crc,
    }
    return b"".join([_pack_header(fields), *parts])


@dataclass(frozen=True)
class _Layout:
    header: Header
    frames: tuple[list[int], ...]  # stored frame lengths, per tensor
    payload_offset: int
    payload_bytes: int
    payload_crc32: int


def _is_int(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _read_prefix(view: memoryview, max_bytes: int | None) -> memoryview:
    """Check magic, version, header length and header crc; return the JSON bytes."""
    if max_bytes is not None and len(view) > max_bytes:
        raise CodecError(f"object of {len(view)} bytes exceeds max_bytes={max_bytes}")
    if len(view) < PREFIX.size:
        raise CodecError(f"truncated: {len(view)} bytes, shorter than the {PREFIX.size}-byte prefix")
    magic, version, flags, header_len, header_crc = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"not a diloco object: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported format version {version} (this reader knows {FORMAT_VERSION})")
    if flags != 0:
        raise CodecError(f"unknown flags {flags:#06x} in prefix")
    if header_len > MAX_HEADER_BYTES:
        raise CodecError(f"header length {header_len} exceeds the limit {MAX_HEADER_BYTES}")
    if PREFIX.size + header_len > len(view):
        raise CodecError(f"truncated: header needs {PREFIX.size + header_len} bytes, object has {len(view)}")
    text = view[PREFIX.size : PREFIX.size + header_len]
    if zlib.crc32(text, zlib.crc32(view[:12])) != header_crc:
        raise CodecError("header checksum mismatch: the header is corrupt")
    return text


def _parse_json(text: memoryview) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(text).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CodecError(f"header is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise CodecError(f"header must be a JSON object, got {type(obj).__name__}")
    if set(obj) != _HEADER_KEYS:
        missing, unknown = sorted(_HEADER_KEYS - set(obj)), sorted(set(obj) - _HEADER_KEYS)
        raise CodecError(f"header keys wrong: missing {missing}, unknown {unknown}")
    return obj


def _check_fields(obj: dict[str, Any]) -> None:
    if obj["format_version"] != FORMAT_VERSION or type(obj["format_version"]) is not int:
        raise CodecError(f"unsupported format_version {obj['format_version']!r} in header")
    if obj["codec"] not in CODECS:
        raise CodecError(f"unknown codec {obj['codec']!r}; expected one of {CODECS}")
    _check_encode_args(obj["codec"], obj["kind"], obj["fingerprint"], obj["block_size"])
    if type(obj["shuffle"]) is not bool:
        raise CodecError(f"shuffle must be a bool, got {obj['shuffle']!r}")
    if not isinstance(obj["meta"], dict):
        raise CodecError(f"meta must be a JSON object, got {type(obj['meta']).__name__}")
    if not isinstance(obj["tensors"], list) or len(obj["tensors"]) > MAX_TENSORS:
        raise CodecError(f"tensors must be a list of at most {MAX_TENSORS} entries")
    if not _is_int(obj["payload_bytes"], 0, 1 << 62) or not _is_int(obj["payload_crc32"], 0, 0xFFFFFFFF):
        raise CodecError("payload_bytes / payload_crc32 must be non-negative ints in range")


def _check_tensor(entry: Any, codec: str, block_size: int) -> tuple[TensorSpec, list[int], int]:
    """One header tensor entry -> (spec, stored frame lengths, elements); sizes checked, nothing allocated."""
    if not isinstance(entry, dict) or set(entry) != {"name", "shape", "frames"}:
        raise CodecError(f"tensor entry must be an object with name, shape, frames; got {str(entry)[:80]}")
    name, shape, frames = entry["name"], entry["shape"], entry["frames"]
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise CodecError(
            f"tensor name must be a non-empty string of at most {MAX_NAME_CHARS} chars: {name!r:.80}"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(_is_int(d, 0, MAX_ELEMENTS) for d in shape)
    ):
        raise CodecError(
            f"tensor {name!r}: shape must be a list of <= {MAX_NDIM} ints in [0, {MAX_ELEMENTS}]: {shape!r:.80}"
        )
    n = _num_elements(tuple(shape))
    if n > MAX_ELEMENTS:
        raise CodecError(f"tensor {name!r}: {n} elements exceed the limit {MAX_ELEMENTS}")
    raw = _stream_bytes(codec, n, block_size)
    num_frames = -(-raw // FRAME_BYTES)
    if not isinstance(frames, list) or len(frames) != num_frames:
        raise CodecError(
            f"tensor {name!r}: expected {num_frames} frames for shape {shape}, header lists {frames!r:.80}"
        )
    for i, (stored, size) in enumerate(zip(frames, _frame_sizes(raw), strict=True)):
        if not _is_int(stored, 1, size) or size > LZ4_MAX_RATIO * stored + 64:
            raise CodecError(f"tensor {name!r}: frame {i} stores {stored!r} bytes for {size} raw bytes")
    return TensorSpec(name, tuple(shape)), frames, n


def _read_layout(data: Any, max_bytes: int | None, allow_partial: bool) -> _Layout:
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise CodecError(f"expected a bytes-like object, got {type(data).__name__}") from None
    text = _read_prefix(view, max_bytes)
    obj = _parse_json(text)
    _check_fields(obj)
    codec, block_size = obj["codec"], obj["block_size"]
    specs, frames, names, total = [], [], set(), 0
    for entry in obj["tensors"]:
        spec, stored, n = _check_tensor(entry, codec, block_size)
        if spec.name in names:
            raise CodecError(f"tensor name {spec.name!r} appears twice")
        total += n
        if total > MAX_ELEMENTS:
            raise CodecError(f"header claims more than {MAX_ELEMENTS} elements in all")
        names.add(spec.name)
        specs.append(spec)
        frames.append(stored)
    offset, payload_bytes = PREFIX.size + len(text), obj["payload_bytes"]
    if sum(sum(f) for f in frames) != payload_bytes:
        raise CodecError(f"payload_bytes {payload_bytes} disagrees with the frame lengths in the header")
    if max_bytes is not None and offset + payload_bytes > max_bytes:
        raise CodecError(f"object claims {offset + payload_bytes} bytes, over max_bytes={max_bytes}")
    if len(view) != offset + payload_bytes and not (allow_partial and len(view) < offset + payload_bytes):
        raise CodecError(
            f"object has {len(view)} bytes, header says {offset + payload_bytes} (truncated or padded)"
        )
    header = Header(
        format_version=FORMAT_VERSION,
        kind=obj["kind"],
        codec=codec,
        block_size=block_size,
        shuffle=obj["shuffle"],
        fingerprint=obj["fingerprint"],
        tensors=tuple(specs),
        meta=obj["meta"],
    )
    return _Layout(header, tuple(frames), offset, payload_bytes, obj["payload_crc32"])


def read_header(data: bytes, *, max_bytes: int | None = None, allow_partial: bool = False) -> Header:
    """Parse and validate the header only (cheap). CodecError on anything malformed.

    The header has its own crc32, so it is verified here; the payload is not (decode does that).
    data must be the whole object unless allow_partial, which accepts a prefix (a range read).
    """
    return _read_layout(data, max_bytes, allow_partial).header


def decode(
    data: bytes, *, max_bytes: int | None = None, expected_fingerprint: str | None = None
) -> tuple[Header, dict[str, np.ndarray]]:
    """bytes -> (header, float32 arrays). Verifies the checksum and every size before allocating."""
    layout = _read_layout(data, max_bytes, allow_partial=False)
    header = layout.header
    if expected_fingerprint is not None and header.fingerprint != expected_fingerprint:
        raise CodecError(
            f"fingerprint mismatch: object has {header.fingerprint!r}, expected {expected_fingerprint!r}"
        )
    view = memoryview(data).cast("B")
    payload = view[layout.payload_offset :]
    if zlib.crc32(payload) != layout.payload_crc32:
        raise CodecError("payload checksum mismatch: the payload is corrupt")
    out: dict[str, np.ndarray] = {}
    pos = 0
    for spec, stored in zip(header.tensors, layout.frames, strict=True):
        raw = _stream_bytes(header.codec, _num_elements(spec.shape), header.block_size)
        stream = _unframe(payload[pos : pos + sum(stored)], stored, raw, spec.name)
        pos += sum(stored)
        out[spec.name] = _decode_stream(stream, header.codec, header.shuffle, header.block_size, spec)
    return header, out

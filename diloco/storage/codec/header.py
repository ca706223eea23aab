"""The codec's container header: format constants and limits, the Header, sizes computed from it, and
the parse-and-validate path that refuses anything malformed before a payload byte is allocated.

Contract: read_header / read_layout raise CodecError naming what is wrong; the sizes here are exact
from the header alone (docs/CODEC.md).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CODECS = ("fp32", "bf16", "int8", "int4", "int3", "int2", "nf2")
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
# lz4 cannot expand a block by more than ~255x; bounds claimed raw sizes (zstd frames too)
MAX_FRAME_RATIO = 256
# How a payload's compressed frames are packed: lz4 (fp32/bf16, and every object written before zstd), or zstd
# (the quantized codecs: their codes are not repetitive, so lz4 stores them raw; zstd's entropy stage takes
# ~1/5 off int4). The header names it only when it is not lz4, so an lz4 object's bytes are what they always
# were.
COMPRESSIONS = ("lz4", "zstd")
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
_OPTIONAL_KEYS = {"compression"}  # absent: "lz4"


class CodecError(ValueError):
    """The object cannot be decoded; the message says exactly why."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    codec: str | None = None  # this tensor's own codec (the entry's optional "codec"); None: the object's


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
    compression: str = "lz4"  # of the frames stored shorter than their raw size (COMPRESSIONS)

    @property
    def num_elements(self) -> int:
        return sum(int(np.prod(t.shape, dtype=np.int64)) for t in self.tensors)


def codec_of(header: Header, spec: TensorSpec) -> str:
    """The codec a tensor of the object is stored in: its entry's own, else the object's."""
    return spec.codec or header.codec


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


def elements_of(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# int3: seven levels in int4's nibbles;
VALUES_PER_BYTE = {"int8": 1, "int4": 2, "int3": 2, "int2": 4, "nf2": 4}
# int2: ternary (-1, 0, 1 x the block's scale); nf2: four levels (-1.5, -0.5, 0.5, 1.5 x the block's scale); 2
# bits each


# values a block shares a scale with, by codec, unless the writer says otherwise (the header records it):
# int3's codes cost ~2.1 bits, so a 4-byte scale per 256 values would be ~6% of an object; per 512 it is half
# that and the step only a little coarser (a run's compact updates: 7% smaller, relative error 0.30 -> 0.33;
# docs/bench/quality.md)
BLOCK_SIZES = {"int3": 512}


def block_size_of(codec: str, block_size: int | None = None) -> int:
    """The block size an object of `codec` is written with: `block_size` if given, else the codec's (256; a
    codec that is not a name gets 256 too, and check_encode_args refuses it)."""
    if block_size is not None:
        return block_size
    return BLOCK_SIZES.get(codec, 256) if isinstance(codec, str) else 256


def stream_bytes(codec: str, n: int, block_size: int) -> int:
    """Raw stream length of one tensor of n elements (exact, from the header alone)."""
    if codec == "fp32":
        return 4 * n
    if codec == "bf16":
        return 2 * n
    nb = -(-n // block_size)
    return 4 * nb + nb * block_size // VALUES_PER_BYTE[codec]


def frame_sizes(raw_bytes: int) -> list[int]:
    return [min(FRAME_BYTES, raw_bytes - s) for s in range(0, raw_bytes, FRAME_BYTES)]


# -------------------------------------------------------------------------------------- header


def check_encode_args(codec: str, kind: str, fingerprint: str, block_size: int) -> None:
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
    if VALUES_PER_BYTE.get(codec) == 4 and block_size % 4:
        raise CodecError(f"{codec} packs 4 values a byte: block_size must be a multiple of 4, "
                         f"got {block_size}")


def check_tensor_codec(codec: Any, block_size: int, name: str) -> str:
    """A tensor entry's own codec: one of CODECS that the object's block size suits; CodecError naming the
    tensor."""
    if not isinstance(codec, str) or codec not in CODECS:
        raise CodecError(f"tensor {name!r:.80}: unknown codec {codec!r:.40}; expected one of {CODECS}")
    if VALUES_PER_BYTE.get(codec) == 4 and block_size % 4:
        raise CodecError(f"tensor {name!r:.80}: {codec} packs 4 values a byte, the object's block_size "
                         f"{block_size} "
                         "is not a multiple of 4")
    return codec


def pack_header(fields: dict[str, Any]) -> bytes:
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


@dataclass(frozen=True)
class Layout:
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
    if not _HEADER_KEYS <= set(obj) <= _HEADER_KEYS | _OPTIONAL_KEYS:
        missing, unknown = sorted(_HEADER_KEYS - set(obj)), sorted(set(obj) - _HEADER_KEYS - _OPTIONAL_KEYS)
        raise CodecError(f"header keys wrong: missing {missing}, unknown {unknown}")
    return obj


def _check_fields(obj: dict[str, Any]) -> None:
    if obj["format_version"] != FORMAT_VERSION or type(obj["format_version"]) is not int:
        raise CodecError(f"unsupported format_version {obj['format_version']!r} in header")
    if obj["codec"] not in CODECS:
        raise CodecError(f"unknown codec {obj['codec']!r}; expected one of {CODECS}")
    check_encode_args(obj["codec"], obj["kind"], obj["fingerprint"], obj["block_size"])
    if obj.get("compression", "lz4") not in COMPRESSIONS:
        raise CodecError(f"unknown compression {obj['compression']!r}; expected one of {COMPRESSIONS}")
    if type(obj["shuffle"]) is not bool:
        raise CodecError(f"shuffle must be a bool, got {obj['shuffle']!r}")
    if not isinstance(obj["meta"], dict):
        raise CodecError(f"meta must be a JSON object, got {type(obj['meta']).__name__}")
    if not isinstance(obj["tensors"], list) or len(obj["tensors"]) > MAX_TENSORS:
        raise CodecError(f"tensors must be a list of at most {MAX_TENSORS} entries")
    if not _is_int(obj["payload_bytes"], 0, 1 << 62) or not _is_int(obj["payload_crc32"], 0, 0xFFFFFFFF):
        raise CodecError("payload_bytes / payload_crc32 must be non-negative ints in range")


_ENTRY_KEYS = {"name", "shape", "frames"}  # and optionally "codec": the tensor's own (absent: the object's)


def _check_tensor(entry: Any, codec: str, block_size: int) -> tuple[TensorSpec, list[int], int]:
    """One header tensor entry -> (spec, stored frame lengths, elements); sizes checked, nothing allocated."""
    if not isinstance(entry, dict) or not _ENTRY_KEYS <= set(entry) <= _ENTRY_KEYS | {"codec"}:
        raise CodecError(f"tensor entry must be an object with name, shape, frames (and maybe codec); "
                         f"got {str(entry)[:80]}")
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
            f"tensor {name!r}: shape must be a list of <= {MAX_NDIM} ints in [0, {MAX_ELEMENTS}]: "
            f"{shape!r:.80}"
        )
    n = elements_of(tuple(shape))
    if n > MAX_ELEMENTS:
        raise CodecError(f"tensor {name!r}: {n} elements exceed the limit {MAX_ELEMENTS}")
    own = check_tensor_codec(entry["codec"], block_size, name) if "codec" in entry else None
    raw = stream_bytes(own or codec, n, block_size)
    num_frames = -(-raw // FRAME_BYTES)
    if not isinstance(frames, list) or len(frames) != num_frames:
        raise CodecError(
            f"tensor {name!r}: expected {num_frames} frames for shape {shape}, header lists {frames!r:.80}"
        )
    for i, (stored, size) in enumerate(zip(frames, frame_sizes(raw), strict=True)):
        if not _is_int(stored, 1, size) or size > MAX_FRAME_RATIO * stored + 64:
            raise CodecError(f"tensor {name!r}: frame {i} stores {stored!r} bytes for {size} raw bytes")
    return TensorSpec(name, tuple(shape), own), frames, n


def read_layout(data: Any, max_bytes: int | None, allow_partial: bool) -> Layout:
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
        compression=obj.get("compression", "lz4"),
    )
    return Layout(header, tuple(frames), offset, payload_bytes, obj["payload_crc32"])


def read_header(data: bytes, *, max_bytes: int | None = None, allow_partial: bool = False) -> Header:
    """Parse and validate the header only (cheap). CodecError on anything malformed.

    The header has its own crc32, so it is verified here; the payload is not (decode does that).
    data must be the whole object unless allow_partial, which accepts a prefix (a range read).
    """
    return read_layout(data, max_bytes, allow_partial).header


def rehead(data: bytes, **meta: Any) -> bytes:
    """The same object with its header's meta updated (the payload and its crc untouched): a delta moved to
    another seq, or a template given a round's. CodecError when `data` is not a well-formed object."""
    offset = read_layout(data, None, allow_partial=False).payload_offset
    fields = json.loads(bytes(memoryview(data)[PREFIX.size:offset]).decode())
    fields["meta"] = {**fields["meta"], **meta}
    return pack_header(fields) + memoryview(data)[offset:]

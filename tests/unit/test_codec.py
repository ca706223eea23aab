"""The delta codec: round-trip error bounds per codec, corruption/truncation detection, hostile headers.

Run: .venv/bin/pytest tests/unit/test_codec.py   (the CLI smoke test shrinks the bench model)
Hostile objects are forged with a valid header crc, so the checks behind the crc are exercised too.
"""

from __future__ import annotations

import json
import pickle
import struct
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from diloco.storage.codec import (
    CODECS,
    FORMAT_VERSION,
    MAGIC,
    CodecError,
    Encoder,
    Header,
    TensorSpec,
    decode,
    encode,
    fingerprint_of,
    object_checksum,
    read_header,
)
from diloco.storage.codec.header import stream_bytes

LEVELS = {"int8": 127, "int4": 7, "int3": 3, "int2": 1}  # nf2 has no zero level: its own test below
shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


def _arrays(draw: Any, shape: tuple[int, ...], log_scale: float) -> np.ndarray:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 10.0**log_scale).astype(np.float32)


@st.composite
def tensor_sets(draw: Any) -> dict[str, np.ndarray]:
    num = draw(st.integers(1, 3))
    log_scale = draw(st.floats(-8, 4))
    return {f"t{i}.weight": _arrays(draw, draw(shapes), log_scale) for i in range(num)}


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    header_len = struct.unpack_from("<I", data, 8)[0]
    return json.loads(data[16 : 16 + header_len]), data[16 + header_len :]


def _forge(obj: Any, payload: bytes = b"", *, version: int = FORMAT_VERSION, magic: bytes = MAGIC) -> bytes:
    """A well-checksummed object with any header JSON: only the semantic checks can refuse it."""
    text = json.dumps(obj).encode()
    head = struct.pack("<4sHHI", magic, version, 0, len(text))
    return head + struct.pack("<I", zlib.crc32(text, zlib.crc32(head))) + text + payload


def _small_object(codec: str = "int8") -> bytes:
    rng = np.random.default_rng(1)
    tensors = {
        "a": rng.standard_normal((3, 50)).astype(np.float32),
        "b": np.float32(2.5) * np.ones((), np.float32),
    }
    return encode(tensors, codec=codec, kind="delta", fingerprint="fp", meta={"seq": 7}, block_size=16)


# ------------------------------------------------------------------------------ round trips


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets(), shuffle=st.booleans())
def test_fp32_round_trip_is_exact(tensors: dict[str, np.ndarray], shuffle: bool) -> None:
    header, out = decode(encode(tensors, codec="fp32", kind="params", fingerprint="f", shuffle=shuffle))
    assert list(out) == list(tensors)
    for name, x in tensors.items():
        assert out[name].dtype == np.float32 and out[name].shape == x.shape
        assert out[name].tobytes() == x.tobytes()
    assert header.tensors == tuple(TensorSpec(k, v.shape) for k, v in tensors.items())


def test_fp32_state_stored_raw_round_trips_exactly_across_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """The version state's format (run/objects.write_state): no shuffle, no lz4, every frame raw; a tensor of
    several frames decodes to its exact bits in a fresh writable array that shares nothing with the object."""
    from diloco.storage.codec import header as codec_header
    from diloco.storage.codec import payload as codec_payload

    monkeypatch.setattr(codec_header, "FRAME_BYTES", 64)
    monkeypatch.setattr(codec_payload, "FRAME_BYTES", 64)
    # zeros: lz4 would shrink them
    tensors = {"w": np.zeros((10, 7), np.float32), "b": np.arange(3, dtype=np.float32)}
    data = encode_tensors_raw(tensors)
    obj, payload = _split(data)
    assert obj["shuffle"] is False and obj["tensors"][0]["frames"] == [64, 64, 64, 64, 24]  # raw, not lz4
    assert len(payload) == 4 * (70 + 3)
    _, out = decode(data)
    for name, x in tensors.items():
        assert out[name].tobytes() == x.tobytes() and out[name].flags.writeable
    out["w"][0, 0] = out["b"][0] = 9.0
    again = decode(data)[1]
    assert again["w"][0, 0] == again["b"][0] == 0.0  # decoded arrays are their own, not views of the object


def encode_tensors_raw(tensors: dict[str, np.ndarray]) -> bytes:
    import torch

    from diloco.run.objects import encode_tensors

    return bytes(encode_tensors({k: torch.from_numpy(v) for k, v in tensors.items()}, codec_name="fp32",
                                kind="params", fingerprint="f", shuffle=False, compress=False))


@settings(max_examples=80, deadline=None)
@given(
    tensors=tensor_sets(),
    codec=st.sampled_from(["int8", "int4", "int3"]),  # int2 clips: its own test below
    block_size=st.sampled_from([2, 16, 64, 256]),
)
def test_quantized_error_is_within_half_a_step_per_block(
    tensors: dict[str, np.ndarray], codec: str, block_size: int
) -> None:
    _, out = decode(encode(tensors, codec=codec, kind="delta", fingerprint="f", block_size=block_size))
    for name, x in tensors.items():
        assert out[name].shape == x.shape and out[name].dtype == np.float32
        flat = x.reshape(-1).astype(np.float64)
        padded = np.zeros(-(-flat.size // block_size) * block_size)
        padded[: flat.size] = flat
        absmax = np.abs(padded.reshape(-1, block_size)).max(axis=1, initial=0.0)
        # half a step, plus fp32 arithmetic: the scale, x * (levels / absmax) and the fp32 result each
        # round; measured worst excess 3.4e-8 x absmax over 1.2M random blocks, so 2^-22 x absmax (a
        # relative slack of 1e-5 of the half step was below that for int8 and failed rarely in CI)
        half = np.repeat(absmax / LEVELS[codec] / 2, block_size)[: flat.size]
        bound = half + np.repeat(absmax, block_size)[: flat.size] * 2.0**-22 + 1e-44
        assert np.all(np.abs(out[name].reshape(-1) - flat) <= bound)


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets(), shuffle=st.booleans())
def test_bf16_relative_error_is_at_most_2_to_minus_8(tensors: dict[str, np.ndarray], shuffle: bool) -> None:
    _, out = decode(encode(tensors, codec="bf16", kind="delta", fingerprint="f", shuffle=shuffle))
    for name, x in tensors.items():
        err = np.abs(out[name].astype(np.float64) - x)
        assert np.all(err <= 2.0**-8 * np.abs(x.astype(np.float64)) + 1e-38)


def test_bf16_rounds_to_nearest_even() -> None:
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF], np.uint32)  # ties, above, below
    _, out = decode(encode({"x": bits.view(np.float32)}, codec="bf16", kind="delta", fingerprint="f"))
    assert out["x"].view(np.uint32).tolist() == [0x3F800000, 0x3F820000, 0x3F810000, 0x3F800000]


@pytest.mark.parametrize("codec", ["int8", "int4", "int3"])
def test_quantized_zero_blocks_and_exact_levels(codec: str) -> None:
    x = np.zeros(300, np.float32)
    x[256:] = np.arange(44, dtype=np.float32) % (LEVELS[codec] + 1)  # integers up to the level count
    x[256] = LEVELS[codec]
    _, out = decode(encode({"x": x}, codec=codec, kind="delta", fingerprint="f"))
    np.testing.assert_array_equal(out["x"], x)


def test_int2_is_ternary_in_two_bits_and_needs_blocks_of_four() -> None:
    x = np.random.default_rng(0).normal(size=4096).astype(np.float32)
    x[5] = 40.0  # an outlier is clipped to the block's scale, not made its scale
    data = encode({"x": x}, codec="int2", kind="update", fingerprint="f")
    _, payload = _split(data)
    assert len(payload) <= 4096 // 4 + 4 * 16  # 2 bits a value + a scale a block, at most (lz4 may shrink it)
    out = decode(data)[1]["x"].reshape(16, 256)
    scale = 1.5 * np.abs(x.reshape(16, 256)).mean(axis=1, keepdims=True)  # codec.payload.TERNARY_SCALE
    assert set(np.unique(np.round(out / scale, 5))) <= {-1.0, 0.0, 1.0}
    mag = np.abs(x.reshape(16, 256))
    assert np.all(out[mag > 0.51 * scale] != 0) and np.all(out[mag < 0.49 * scale] == 0)  # rint(x / scale)
    normal = np.r_[x[:5], x[6:]]
    shipped = np.r_[out.reshape(-1)[:5], out.reshape(-1)[6:]]
    assert np.linalg.norm(shipped - normal) / np.linalg.norm(normal) < 0.5  # absmax scaling: ~0.8
    with pytest.raises(CodecError, match="multiple of 4"):
        encode({"x": x}, codec="int2", kind="update", fingerprint="f", block_size=6)


def test_int3_has_seven_levels_in_blocks_of_512_and_fewer_bytes_than_int4() -> None:
    x = np.zeros(1024, np.float32)
    x[:8] = [3.0, 0.49, 0.51, -0.51, 1.49, 1.51, -2.9, 2.2]  # absmax 3: a step of exactly 1
    x[512] = 6.0  # the second block of 512 has its own scale: a step of 2
    x[513:516] = [0.9, 1.1, -3.1]
    data = encode({"x": x}, codec="int3", kind="update", fingerprint="f")
    header, out = decode(data)
    assert header.block_size == 512 and out["x"][:8].tolist() == [3.0, 0.0, 1.0, -1.0, 1.0, 2.0, -3.0, 2.0]
    assert out["x"][512:516].tolist() == [6.0, 0.0, 2.0, -4.0]  # rint(x / 2) x 2
    assert decode(encode({"x": x}, codec="int3", kind="update", fingerprint="f",
                         block_size=256))[0].block_size == 256
    gauss = np.random.default_rng(2).normal(size=1 << 16).astype(np.float32)
    sizes = {c: len(encode({"g": gauss}, codec=c, kind="update", fingerprint="f")) for c in ("int4", "int3")}
    assert sizes["int3"] < 0.7 * sizes["int4"]  # the same nibbles, but zstd takes back the unused codes
    shipped = decode(encode({"g": gauss}, codec="int3", kind="update", fingerprint="f"))[1]["g"]
    steps = np.abs(gauss.reshape(-1, 512)).max(1, keepdims=True) / 3
    assert set(np.unique(np.round(shipped.reshape(-1, 512) / steps,
                                  4))) <= {-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0}
    assert 0.25 < np.linalg.norm(shipped - gauss) / np.linalg.norm(gauss) < 0.35


def test_nf2_spends_all_four_codes_on_a_mid_rise_grid() -> None:
    x = np.random.default_rng(1).normal(size=4096).astype(np.float32)
    x[7] = -30.0  # an outlier is clipped to the grid's end, its error left to the residual
    data = encode({"x": x}, codec="nf2", kind="update", fingerprint="f")
    _, payload = _split(data)
    assert len(payload) <= 4096 // 4 + 4 * 16  # 2 bits a value + a scale a block, at most
    out = decode(data)[1]["x"].reshape(16, 256)
    blocks = x.reshape(16, 256)
    scale = 1.25 * np.abs(blocks).mean(axis=1, keepdims=True)  # codec.payload.NF2_SCALE
    q = np.clip(np.floor(blocks / scale), -2, 1)  # the code, decoded at the middle of its cell
    np.testing.assert_allclose(out, (q + 0.5) * scale, rtol=1e-6, atol=1e-7)
    assert set(np.unique(np.round(out / scale, 5))) == {-1.5, -0.5, 0.5, 1.5}  # every code in use, no zero
    normal, shipped = np.delete(x, 7), np.delete(out.reshape(-1), 7)
    ternary = decode(encode({"x": x}, codec="int2", kind="update", fingerprint="f"))[1]["x"]
    err = np.linalg.norm(shipped - normal) / np.linalg.norm(normal)
    assert err < 0.37 and err < np.linalg.norm(np.delete(ternary, 7) - normal) / np.linalg.norm(normal) - 0.05
    zeros = encode({"z": np.zeros(300, np.float32)}, codec="nf2", kind="update", fingerprint="f")
    assert not decode(zeros)[1]["z"].any()  # a block of zeros has scale 0: zeros come back
    with pytest.raises(CodecError, match="nf2 packs 4 values a byte"):
        encode({"x": x}, codec="nf2", kind="update", fingerprint="f", block_size=6)


def test_meta_kind_and_order_survive() -> None:
    meta = {
        "base_version": 3,
        "seq": 12,
        "learner": "us-east-0",
        "tokens": 10**12,
        "loss": 2.5,
        "tags": [1, "a"],
    }
    tensors = {"z": np.ones(3, np.float32), "a": np.zeros((2, 2), np.float32)}
    data = encode(tensors, codec="int4", kind="update", fingerprint="abc", meta=meta)
    header, out = decode(data)
    assert (header.kind, header.codec, header.fingerprint, header.meta) == ("update", "int4", "abc", meta)
    assert list(out) == ["z", "a"] and header.num_elements == 7
    assert read_header(data) == header
    assert isinstance(header, Header) and header.format_version == FORMAT_VERSION


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_lossless_codecs_carry_non_finite_values(codec: str) -> None:
    x = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    _, out = decode(encode({"x": x}, codec=codec, kind="delta", fingerprint="f"))
    assert np.isnan(out["x"][0]) and out["x"][1] == np.inf and out["x"][2] == -np.inf


@pytest.mark.parametrize("codec", ["int8", "int4", "int3", "int2", "nf2"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantized_codecs_refuse_non_finite_input(codec: str, bad: float) -> None:
    x = np.ones(1000, np.float32)
    x[700] = bad
    with pytest.raises(CodecError, match="non-finite values in tensor 'w'"):
        encode({"w": x}, codec=codec, kind="delta", fingerprint="f")


def test_encode_refuses_bad_arguments() -> None:
    ok = {"x": np.ones(4, np.float32)}
    for kwargs in ({"codec": "int5"}, {"block_size": 7}, {"block_size": 0}, {"kind": "Bad Kind"}):
        args = {"codec": "int8", "kind": "delta", "fingerprint": "f", **kwargs}
        with pytest.raises(CodecError):
            encode(ok, **args)
    with pytest.raises(CodecError, match="float64"):
        encode({"x": np.ones(4)}, codec="fp32", kind="delta", fingerprint="f")
    with pytest.raises(CodecError, match="JSON"):
        encode(ok, codec="fp32", kind="delta", fingerprint="f", meta={"x": object()})
    with pytest.raises(CodecError, match="names"):
        encode({"": np.ones(1, np.float32)}, codec="fp32", kind="delta", fingerprint="f")


def test_encode_is_deterministic_and_checksum_is_hex() -> None:
    assert _small_object() == _small_object()
    checksum = object_checksum(_small_object())
    assert len(checksum) == 32 and int(checksum, 16) >= 0
    assert object_checksum(_small_object("int4")) != checksum


def test_fingerprint_is_stable_and_sensitive() -> None:
    specs = [("a", (2, 3)), ("b", ())]
    assert fingerprint_of(specs) == fingerprint_of(list(specs))
    assert fingerprint_of(specs) != fingerprint_of([("a", (3, 2)), ("b", ())])
    assert fingerprint_of(specs) != fingerprint_of(specs, extra="d_model=64")
    assert fingerprint_of(specs) != fingerprint_of(specs[::-1])


# ---------------------------------------------------------------------------- damage


@pytest.mark.parametrize("codec", CODECS)
def test_every_flipped_byte_is_detected(codec: str) -> None:
    data = _small_object(codec)
    for pos in range(len(data)):
        for mask in (0x01, 0x80):
            damaged = bytearray(data)
            damaged[pos] ^= mask
            with pytest.raises(CodecError):
                decode(bytes(damaged))


@pytest.mark.parametrize("codec", CODECS)
def test_truncation_and_padding_are_detected(codec: str) -> None:
    data = _small_object(codec)
    for cut in range(len(data)):
        with pytest.raises(CodecError):
            decode(data[:cut])
    with pytest.raises(CodecError, match="truncated or padded"):
        decode(data + b"\0")


def test_read_header_accepts_a_prefix_only_when_asked() -> None:
    data = _small_object()
    header_end = 16 + struct.unpack_from("<I", data, 8)[0]
    assert read_header(data[:header_end], allow_partial=True).meta == {"seq": 7}
    with pytest.raises(CodecError):
        read_header(data[:header_end])
    with pytest.raises(CodecError, match="truncated"):
        read_header(data[: header_end - 1], allow_partial=True)


def test_fingerprint_mismatch_names_both() -> None:
    with pytest.raises(CodecError, match="'fp'.*'other'"):
        decode(_small_object(), expected_fingerprint="other")
    assert decode(_small_object(), expected_fingerprint="fp")[0].fingerprint == "fp"


def test_max_bytes() -> None:
    data = _small_object()
    decode(data, max_bytes=len(data))
    with pytest.raises(CodecError, match="max_bytes"):
        decode(data, max_bytes=len(data) - 1)
    header_end = 16 + struct.unpack_from("<I", data, 8)[0]
    with pytest.raises(CodecError, match="max_bytes"):
        read_header(data[:header_end], allow_partial=True, max_bytes=header_end)


# -------------------------------------------------------------------------- hostile input


def _edit(change: dict[str, Any], tensor_change: dict[str, Any] | None = None) -> bytes:
    obj, payload = _split(_small_object())
    obj.update(change)
    if tensor_change is not None:
        obj["tensors"][0].update(tensor_change)
    return _forge(obj, payload)


HOSTILE = {
    "pickle": pickle.dumps({"a": np.ones(3)}),
    "empty": b"",
    "wrong magic": _small_object().replace(MAGIC, b"PK\x03\x04", 1),
    "binary version 2": _forge(_split(_small_object())[0], _split(_small_object())[1], version=2),
    "json version 99": _edit({"format_version": 99}),
    "json version bool": _edit({"format_version": True}),
    "unknown codec": _edit({"codec": "int2"}),
    "header length beyond data": _small_object()[:8] + struct.pack("<I", 2**31) + _small_object()[12:],
    "json list": _forge([1, 2, 3]),
    "json string": _forge("DLCO"),
    "not json": MAGIC + struct.pack("<HHI", 1, 0, 3) + struct.pack("<I", 0) + b"{{{",
    "deep json": _forge(json.loads("[" * 50 + "]" * 50)),
    "unknown key": _edit({"extra": 1}),
    "huge shape": _edit({}, {"shape": [10**6, 10**6]}),
    "negative shape": _edit({}, {"shape": [-3, 50]}),
    "float shape": _edit({}, {"shape": [3.0, 50]}),
    "too many dims": _edit({}, {"shape": [1] * 40}),
    "shape vs payload": _edit({}, {"shape": [3, 60]}),
    "name not a string": _edit({}, {"name": 5}),
    "duplicate names": _edit({}, {"name": "b"}),
    "frames negative": _edit({}, {"frames": [-1]}),
    "payload_bytes lies": _edit({"payload_bytes": 10**15}),
    "block size odd": _edit({"block_size": 15}),
    "shuffle not bool": _edit({"shuffle": "yes"}),
    "meta a list": _edit({"meta": [1]}),
    "payload crc lies": _edit({"payload_crc32": 1}),
    "unknown compression": _edit({"compression": "brotli"}),
    "compression not a string": _edit({"compression": ["zstd"]}),
    "tensor codec unknown": _edit({}, {"codec": "int9"}),
    "tensor codec not a string": _edit({}, {"codec": ["fp32"]}),
    "tensor codec resizes its stream": _edit({}, {"codec": "fp32"}),  # int8-sized frames read as fp32
    "tensor entry with another key": _edit({}, {"dtype": "int64"}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_objects_are_refused(case: str) -> None:
    with pytest.raises(CodecError):
        decode(HOSTILE[case])


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4", "nf2"])
def test_a_tensor_may_carry_its_own_codec(codec: str) -> None:
    """A model's buffers in a quantized delta: entries of their own codec (fp32) decode exactly, 0-d shapes
    kept; the other entries decode to the bits of an object without them, and carry no `codec` key."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(300).astype(np.float32)
    running_var, steps = (rng.random(7) * 100).astype(np.float32), np.float32(12345)
    encoder = Encoder(codec=codec, kind="delta", fingerprint="f", meta={"buffers": 2})
    encoder.add("w", x)
    encoder.add("bn.running_var", running_var, codec="fp32")
    encoder.add("bn.num_batches_tracked", steps, codec="fp32")
    header, out = decode(encoder.finish())
    assert np.array_equal(out["bn.running_var"], running_var) and out["bn.num_batches_tracked"].shape == ()
    assert out["bn.num_batches_tracked"] == steps
    own = None if codec == "fp32" else "fp32"
    assert [t.codec for t in header.tensors] == [None, own, own]
    plain = encode({"w": x}, codec=codec, kind="delta", fingerprint="f")
    assert "codec" not in _split(plain)[0]["tensors"][0]
    assert np.array_equal(out["w"], decode(plain)[1]["w"])


def test_a_tensor_codec_must_suit_the_objects_block_size() -> None:
    obj, payload = _split(encode({"a": np.ones(36, np.float32)}, codec="int8", kind="delta", fingerprint="f",
                                 block_size=18))
    obj["tensors"][0]["codec"] = "nf2"  # four values a byte: blocks of 18 do not pack
    with pytest.raises(CodecError, match="packs 4 values a byte"):
        decode(_forge(obj, payload))
    with pytest.raises(CodecError, match="unknown codec"):
        Encoder(codec="int8", kind="delta", fingerprint="f").add("a", np.ones(3, np.float32), codec="int9")


def test_non_bytes_input_is_refused() -> None:
    with pytest.raises(CodecError, match="bytes-like"):
        decode("DLCO")  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", ["int8", "int4", "int3", "int2", "nf2"])
@pytest.mark.parametrize("scale", [np.nan, np.inf, -1.0])
def test_bad_block_scales_are_refused(codec: str, scale: float) -> None:
    x = np.linspace(-1, 1, 32, dtype=np.float32)
    obj, payload = _split(encode({"x": x}, codec=codec, kind="delta", fingerprint="f", block_size=16))
    assert obj["tensors"][0]["frames"] == [len(payload)]  # quantized bytes do not compress: stored raw
    forged = bytearray(payload)
    forged[4:8] = struct.pack("<f", scale)  # second block's scale
    obj["payload_crc32"] = zlib.crc32(bytes(forged))
    with pytest.raises(CodecError, match="scales"):
        decode(_forge(obj, bytes(forged)))


@pytest.mark.parametrize(
    ("shape", "frames"),
    [
        ([10**6, 10**6], [1]),
        ([2**30], [1] * 64),
        ([2**18, 2**18], [1] * 64),
        ([2**22], [1]),
        ([2**22], [10**9]),
    ],
)
def test_hostile_sizes_are_refused_before_allocating(shape: list[int], frames: list[int]) -> None:
    obj, payload = _split(_small_object())
    obj["tensors"][0]["shape"] = shape
    obj["tensors"][0]["frames"] = frames
    forged = _forge(obj, payload)
    tracemalloc.start()
    try:
        with pytest.raises(CodecError):
            decode(forged)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# ------------------------------------------------------------------------------ zstd frames


def _skewed(n: int, seed: int = 0) -> np.ndarray:
    """Laplace values, like a delta's: most of a block near zero, a few large (int4 codes ~3 bits of
    entropy)."""
    return np.random.default_rng(seed).laplace(size=n).astype(np.float32)


@pytest.mark.parametrize("codec", ["int8", "int4", "int3", "int2", "nf2"])
def test_quantized_frames_are_zstd_and_smaller_than_raw(codec: str) -> None:
    x = {"w": _skewed(1 << 16)}
    data = encode(x, codec=codec, kind="delta", fingerprint="f")
    obj, payload = _split(data)
    raw = stream_bytes(codec, len(x["w"]), obj["block_size"])  # scales + codes (int3: 512 a block)
    assert obj["compression"] == "zstd" and read_header(data).compression == "zstd"
    assert len(payload) < 0.95 * raw  # the entropy stage: lz4 stored these codes raw
    y = decode(data)[1]["w"]
    forced_raw = Encoder(codec=codec, kind="delta", fingerprint="f", compress=False)
    forced_raw.add("w", x["w"])
    assert np.array_equal(y, decode(forced_raw.finish())[1]["w"])  # the same values, bit for bit


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_float_frames_stay_lz4_with_no_compression_key(codec: str) -> None:
    obj, _ = _split(encode({"w": _skewed(4096)}, codec=codec, kind="params", fingerprint="f"))
    assert "compression" not in obj  # an lz4 object's header (and bytes) are what they were before zstd


def test_objects_with_lz4_quantized_frames_still_decode() -> None:
    """Objects written before zstd: quantized streams in lz4 frames, no `compression` key."""
    x = np.zeros(1 << 14, np.float32)  # zeros: lz4 does shrink these, so the frame is a real lz4 block
    x[::7] = _skewed(len(x[::7]))
    enc = Encoder(codec="int4", kind="delta", fingerprint="f")
    enc.compression = "lz4"
    enc.add("w", x)
    data = enc.finish()
    obj, payload = _split(data)
    assert "compression" not in obj and obj["tensors"][0]["frames"][0] < 4 * 64 + len(x) // 2
    assert np.array_equal(decode(data)[1]["w"], decode(encode({"w": x}, codec="int4", kind="delta",
                                                                 fingerprint="f"))[1]["w"])


def test_a_zero_tensor_is_padded_to_the_ratio_bound_and_decodes() -> None:
    """zstd shrinks zeros ~20,000x; decode refuses more than 256x, so the frame carries a skippable pad."""
    n = 1 << 22  # 2 MiB of int4 codes + scales: one frame
    data = encode({"w": np.zeros(n, np.float32)}, codec="int4", kind="update", fingerprint="f")
    obj, _ = _split(data)
    raw = 4 * (n // 256) + n // 2
    stored = obj["tensors"][0]["frames"][0]
    assert raw <= 256 * stored + 64 and stored < raw // 200  # at the bound: lz4's best, no better
    assert not decode(data)[1]["w"].any()


def test_a_corrupt_zstd_frame_is_refused_by_name() -> None:
    obj, payload = _split(encode({"w": _skewed(1 << 14)}, codec="int4", kind="delta", fingerprint="f"))
    forged = bytearray(payload)
    forged[0] ^= 0xFF  # the zstd frame's magic
    obj["payload_crc32"] = zlib.crc32(bytes(forged))
    with pytest.raises(CodecError, match="zstd frame 0 is corrupt"):
        decode(_forge(obj, bytes(forged)))
    obj["compression"], obj["payload_crc32"] = "lz4", zlib.crc32(payload)  # zstd bytes read as lz4: refused
    with pytest.raises(CodecError, match="lz4 frame 0"):
        decode(_forge(obj, bytes(payload)))


# ------------------------------------------------------------------------------- bench CLI


def test_bench_codec_cli_writes_json(tmp_path: Path) -> None:
    from diloco.cli import app

    out = tmp_path / "codec.json"
    args = ["bench", "codec", "--json", str(out), "--num-params", "20000", "--steps", "2", "--repeats", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["reference"]) >= {"copy_mb_s", "lz4_mb_s"}
    assert set(report["codecs"]) == set(CODECS)
    for codec, r in report["codecs"].items():
        assert set(r) >= {"ratio", "encode_mb_s", "decode_mb_s", "max_abs_error"}
        assert r["encode_mb_s"] > 0 and r["decode_mb_s"] > 0
        assert (r["max_abs_error"] == 0.0) == (codec == "fp32")
    assert report["codecs"]["int8"]["ratio"] > 3.0 and report["codecs"]["int4"]["ratio"] > 5.0


@settings(max_examples=40, deadline=None)
@given(
    tensors=tensor_sets(),
    codec=st.sampled_from(sorted(CODECS)),
    shuffle=st.booleans(),
    block_size=st.sampled_from([4, 16, 64]),
    workers=st.integers(1, 3),
    chunk=st.sampled_from([4, 64, 1 << 16]),
)
def test_adding_a_tensor_as_it_decodes_is_adding_the_decoded_tensor(
    tensors: dict[str, np.ndarray], codec: str, shuffle: bool, block_size: int, workers: int, chunk: int
) -> None:
    """LazyObject.add_to (a rejoin's updates, decoded a chunk at a time into the params, rows split between
    threads) has the bits of `out + array(name)`, for every codec, shape (0-d, empty, a padded last block),
    chunk size and number of workers."""
    from diloco.storage.codec import LazyObject, payload

    data = encode(tensors, codec=codec, kind="update", fingerprint="f", block_size=block_size,
                  shuffle=shuffle)
    rng = np.random.default_rng(len(data))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(payload, "_CHUNK_ELEMENTS", chunk)  # many chunks and worker ranges in small tensors
        obj = LazyObject(data)
        for name, x in tensors.items():
            base = rng.standard_normal(x.shape).astype(np.float32)
            want = base + obj.array(name)
            got = base.copy()
            obj.add_to(name, got, workers=workers)
            assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))
        with pytest.raises(ValueError, match="contiguous f32"):
            obj.add_to(next(iter(tensors)), np.zeros(7, np.float64))

"""The codec's streaming encoder: consuming a dict tensor by tensor into a bytearray writes the bytes of
`encode`, and `Encoder.shipped` is what `decode` gives back, for every codec (so is `encode_shipped`'s, the
learners' ship); fp32's plane-wise unshuffle round-trips NaN, Inf and -0.0 bit for bit; a tensor decoded
into a used buffer (the merge's recycled memory) is decode's, bit for bit, in that buffer; the block codecs'
chunked dequantizer (torch's kernels) gives the plain numpy formula's bits.
Run: .venv/bin/pytest tests/unit/test_codec_stream.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco.run.objects import decode_tensors, encode_shipped, encode_tensors
from diloco.storage.codec import Encoder
from diloco.storage.codec.header import VALUES_PER_BYTE, TensorSpec
from diloco.storage.codec.lazy import LazyObject
from diloco.storage.codec.payload import _DEQUANT_CHUNK_ELEMENTS, add_decoded, decode_stream, encode_stream

SHAPES = {"a": (40, 64), "b": (33, 7), "c": (5,), "d": (1 << 17,)}


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_the_consuming_encoder_writes_the_codecs_bytes(codec):
    gen = torch.Generator().manual_seed(6)
    tensors = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    expected = encode_tensors(tensors, codec_name=codec, kind="params", fingerprint="fp", meta={"x": 1})
    consumed = dict(tensors)
    got = encode_tensors(consumed, codec_name=codec, kind="params", fingerprint="fp", meta={"x": 1},
                         consume=True)
    assert bytes(got) == expected and consumed == {}


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4", "int3", "int2", "nf2"])
def test_the_encoders_shipped_tensor_is_what_decode_gives_back(codec):
    gen = torch.Generator().manual_seed(8)
    tensors = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    encoder = Encoder(codec=codec, kind="update", fingerprint="fp")
    shipped = {k: encoder.shipped(k, tuple(v.shape), encoder.add(k, v.numpy())) for k, v in tensors.items()}
    _, decoded = decode_tensors(encoder.finish())
    assert all(np.array_equal(shipped[k], decoded[k].numpy()) for k in tensors)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4", "int3", "int2", "nf2"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_encode_shipped_is_the_encoded_bytes_and_their_decode(codec, shuffle):
    gen = torch.Generator().manual_seed(9)
    tensors = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    kwargs = {"codec_name": codec, "kind": "delta", "fingerprint": "fp", "meta": {"seq": 3},
              "shuffle": shuffle}
    data, shipped = encode_shipped(tensors, **kwargs)
    assert bytes(data) == bytes(encode_tensors(tensors, **kwargs))
    _, decoded = decode_tensors(data)
    assert list(shipped) == list(decoded)
    assert all(shipped[k].shape == decoded[k].shape and torch.equal(shipped[k], decoded[k]) for k in decoded)


def test_fp32_round_trips_special_values_bit_for_bit():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3.4e38, 1.5], np.float32)
    _, out = decode_tensors(encode_tensors({"x": torch.from_numpy(x)}, codec_name="fp32", kind="params",
                                           fingerprint="fp"))
    assert out["x"].numpy().tobytes() == x.tobytes()



@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4", "int3", "int2", "nf2"])
def test_a_tensor_decoded_into_a_used_buffer_is_decodes_bits(codec):
    gen = torch.Generator().manual_seed(9)
    tensors = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    data = encode_tensors(tensors, codec_name=codec, kind="delta", fingerprint="fp")
    _, decoded = decode_tensors(data)
    obj = LazyObject(data)
    for name, shape in SHAPES.items():
        used = np.full(int(np.prod(shape)), np.nan, np.float32)  # a folded tensor's memory: old values
        got = obj.array(name, out=used)
        assert got.shape == shape and np.array_equal(got, decoded[name].numpy())
        # block-quantized streams decode into the buffer; the others into a fresh array, the buffer untouched
        assert np.shares_memory(got, used) == (codec not in ("fp32", "bf16"))
    wrong = np.zeros(7, np.float32)  # a buffer that does not fit is not used
    assert not np.shares_memory(LazyObject(data).array("a", out=wrong), wrong)


def _reference_dequantize(stream: np.ndarray, codec: str, n: int, bsz: int = 64) -> np.ndarray:
    """The block codecs' decode written plainly in numpy, whole: the nibbles sign-extended, times their
    block's scale in f32 (nf2: plus half the scale)."""
    nb, per = -(-n // bsz), VALUES_PER_BYTE[codec]
    scales = stream[: 4 * nb].copy().view(np.float32)[:, None]
    q = stream[4 * nb :].view(np.int8).reshape(nb, bsz // per)
    bits, c = 8 // per, bsz // per
    out = np.empty((nb, bsz), np.float32)
    for k in range(per):
        top = 8 - bits * (k + 1)
        value = q if per == 1 else (np.left_shift(q, top) if top else q) >> (8 - bits)
        out[:, k * c : (k + 1) * c] = value * scales
        if codec == "nf2":
            out[:, k * c : (k + 1) * c] += 0.5 * scales
    return out.reshape(-1)[:n]


@pytest.mark.parametrize("codec", ["int8", "int4", "int3", "int2", "nf2"])
def test_dequantizing_by_chunks_gives_the_plain_formulas_bits(codec):
    """decode_stream and add_decoded (torch's kernels, a chunk of rows at a time, workers on ranges) give the
    bits of the plain numpy formula, at every size around a block's and a chunk's edge."""
    rng = np.random.default_rng(3)
    chunk = _DEQUANT_CHUNK_ELEMENTS
    for n in (1, 63, 64, 65, 1000, chunk - 1, chunk + 65, 2 * chunk + 7):
        x = rng.standard_normal(n, dtype=np.float32)
        stream, spec = encode_stream(x, codec, False, 64, "w"), TensorSpec("w", (n,))
        expected = _reference_dequantize(stream, codec, n)
        assert np.array_equal(decode_stream(stream, codec, False, 64, spec), expected), n
        base = rng.standard_normal(n, dtype=np.float32)
        for workers in (1, 2):
            out = base.copy()
            add_decoded(stream, codec, False, 64, spec, out, workers)
            assert np.array_equal(out, base + expected), (n, workers)

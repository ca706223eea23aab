"""Any tensor a user's model can hold goes through every path that writes or reads tensors: random layouts
with the awkward shapes drawn often (0-d, one element, empty, odd lengths, one past and one short of a block
or a pack), in random order, through every codec, checked against a plain reference.

The paths: a learner's delta (whole model and fragment lanes), the merger's in-place outer step against the
pure `outer_step`, a version's params and outer state (format 1's objects, and a chain's checkpoint split over
parts), the learner's optimizer checkpoint (AdamW state of
fp32, bf16 and fp16 parameters), its local state, and the model the evaluator and export load. The reference
for the codecs is `reference_decode` below: the block quantizers written out in whole-array numpy, bit for bit
what docs/CODEC.md says.

Run: .venv/bin/pytest tests/unit/test_any_layout.py   (about 20 s)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from diloco.configs import load_config
from diloco.learner.local_state import LocalState
from diloco.merger.inplace import outer_step_in_place
from diloco.merger.step import GradientStream, LearnerGroup, OuterState, outer_optimizer, outer_step
from diloco.run.checkpoint import read_checkpoint, write_checkpoint
from diloco.run.create import create_run
from diloco.run.objects import decode_tensors, encode_shipped, encode_tensors, read_tensors, write_state
from diloco.storage import open_store
from diloco.storage.codec import CODECS, Header
from diloco.storage.codec.header import VALUES_PER_BYTE, block_size_of
from diloco.storage.codec.payload import NF2_SCALE, TERNARY_SCALE
from diloco.training.fragments import plan_fragments, put_, take
from diloco.training.model import get_flat_params, set_params
from diloco.training.optim_state import export_state, import_state
from diloco.training.spec import model_layout
from diloco.training.tensors import clone

LEVELS = {"int8": 127, "int4": 7, "int3": 3, "int2": 1, "nf2": 1}
# lengths at the edges of every block size the codecs use (256; int3's 512) and of every pack (2 and 4 a byte)
EDGES = [0, 1, 2, 3, 4, 5, 7, 255, 256, 257, 511, 512, 513]
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def shapes(draw: Any) -> tuple[int, ...]:
    kind = draw(st.sampled_from(["scalar", "edge", "edge", "matrix", "empty", "odd3d"]))
    if kind == "scalar":
        return ()
    if kind == "edge":
        return (draw(st.sampled_from(EDGES[1:])),)
    if kind == "matrix":
        return (draw(st.integers(1, 40)), draw(st.sampled_from([1, 3, 31, 65])))
    if kind == "empty":
        return draw(st.sampled_from([(0,), (0, 4), (3, 0)]))
    return (draw(st.integers(1, 5)), draw(st.integers(1, 7)), draw(st.integers(1, 9)))


@st.composite
def layouts(draw: Any) -> dict[str, torch.Tensor]:
    """name -> fp32 tensor; at least one tensor with an element (a model with nothing to train is refused)."""
    num = draw(st.integers(1, 6))
    dims = draw(st.lists(shapes(), min_size=num, max_size=num))
    if all(int(np.prod(s)) == 0 for s in dims):
        dims.append((1,))
    names = draw(st.permutations([f"m{i}.p" for i in range(len(dims))]))  # random order, not sorted
    scale = 10.0 ** draw(st.floats(-6, 2))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return {name: torch.randn(dim, generator=gen) * scale for name, dim in zip(names, dims, strict=True)}


def reference_decode(x: np.ndarray, codec: str) -> np.ndarray:
    """What `codec` ships for x (any shape): the whole tensor quantized at once, padded with zeros to whole
    blocks."""
    if codec == "fp32":
        return x.copy()
    if codec == "bf16":
        return torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    bsz, flat = block_size_of(codec), x.reshape(-1)
    blocks = np.zeros(-(-flat.size // bsz) * bsz, np.float32)
    blocks[: flat.size] = flat
    blocks = blocks.reshape(-1, bsz)
    scale_of = np.abs(blocks).mean(axis=1) * np.float32({"int2": TERNARY_SCALE, "nf2": NF2_SCALE}[codec]) \
        if codec in ("int2", "nf2") else np.abs(blocks).max(axis=1)
    levels = LEVELS[codec]
    inv = np.zeros_like(scale_of)
    np.divide(levels, scale_of, out=inv, where=scale_of > 0)
    q = blocks * inv[:, None]
    q = np.clip(np.floor(q), -2, 1) if codec == "nf2" else np.clip(np.rint(q), -levels, levels)
    step = (scale_of * np.float32(1.0 / levels))[:, None]
    y = q * step + (np.float32(0.5) * step if codec == "nf2" else 0)
    return y.astype(np.float32).reshape(-1)[: flat.size].reshape(x.shape)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype
                                      and torch.equal(a[k], b[k]) for k in a)


@SETTINGS
@given(params=layouts(), codec=st.sampled_from(CODECS))
def test_a_delta_of_any_layout_decodes_to_what_was_shipped_and_to_the_reference(
        params: dict, codec: str) -> None:
    data, shipped = encode_shipped(params, codec_name=codec, kind="delta", fingerprint="f")
    header, decoded = decode_tensors(data)
    assert (_same(decoded, shipped)
            and [t.shape for t in header.tensors] == [tuple(v.shape) for v in params.values()])
    for name, x in params.items():
        np.testing.assert_array_equal(decoded[name].numpy(), reference_decode(x.numpy(), codec), err_msg=name)
    # the consuming encode (a version's state, a checkpoint) writes the same bytes
    assert encode_tensors(clone(params), codec_name=codec, kind="delta", fingerprint="f", consume=True) == \
        encode_tensors(params, codec_name=codec, kind="delta", fingerprint="f")


@SETTINGS
@given(params=layouts(), codec=st.sampled_from(CODECS), data=st.data())
def test_fragment_lanes_of_any_layout_cover_every_element_once(params: dict, codec: str, data: Any) -> None:
    layout = [{"name": k, "shape": list(v.shape)} for k, v in params.items()]
    count = data.draw(st.integers(1, 4))
    try:
        fragments = plan_fragments(layout, count)
    except ValueError:  # more fragments than the model has pieces: refused with a reason, never a wrong split
        assume_refused = count > 1
        assert assume_refused
        return
    whole = {k: torch.zeros_like(v) for k, v in params.items()}
    marks = {k: torch.zeros_like(v) for k, v in params.items()}
    for fragment in fragments:
        part = take(params, fragment)
        payload, shipped = encode_shipped(part, codec_name=codec, kind="delta", fingerprint="f")
        _, decoded = decode_tensors(payload)
        assert _same(decoded, shipped)
        put_(whole, fragment, decoded)
        put_(marks, fragment, {k: torch.ones_like(v) for k, v in part.items()})
    # every element in exactly one piece
    assert all(torch.equal(m, torch.ones_like(m)) for m in marks.values())
    if codec == "fp32":
        assert _same(whole, params)


@SETTINGS
@given(params=layouts(), codec=st.sampled_from(CODECS), momentum=st.sampled_from([0.0, 0.9]),
       first=st.booleans())
def test_the_in_place_outer_step_is_the_pure_step_for_any_layout(params: dict, codec: str, momentum: float,
                                                                  first: bool) -> None:
    cfg = load_config("tiny").with_overrides({"outer.update_codec": codec, "outer.momentum": momentum})
    optimizer = outer_optimizer(cfg, 2)
    gen = torch.Generator().manual_seed(7)
    deltas = [{k: torch.randn(v.shape, generator=gen) * 1e-2 for k, v in params.items()} for _ in range(2)]
    outer = None if first else OuterState({k: torch.randn(v.shape, generator=gen) for k, v in params.items()},
                                          {k: torch.randn(v.shape, generator=gen) * 1e-3
                                           for k, v in params.items()})

    def stream() -> GradientStream:
        s = GradientStream(0, cfg.outer.merge_rule, cfg.outer.staleness_power)
        for i, delta in enumerate(deltas):
            group = LearnerGroup(f"l{i}")
            header = Header(1, "delta", "fp32", 256, True, "f", (), {"tokens": 64 * (i + 1), "steps": 10,
                                                                    "base_version": 0})
            group.add(0, header, clone(delta))
            s.add(group)
        return s

    pure = outer_step(params, outer or OuterState.zeros_like(params), stream(), "f", optimizer)
    in_place = outer_step_in_place(clone(params), None if outer is None else
                                   OuterState(clone(outer.momentum), clone(outer.residual)), stream(), "f",
                                   optimizer)
    assert in_place.update_bytes == pure.update_bytes
    assert _same(in_place.params, pure.params) and _same(in_place.outer.momentum, pure.outer.momentum)
    assert _same(in_place.outer.residual, pure.outer.residual)
    _, update = decode_tensors(pure.update_bytes)
    assert _same({k: params[k] + update[k] for k in params}, pure.params)  # G_v = G_{v-1} + decode(update_v)


@SETTINGS
@given(params=layouts())
def test_a_versions_params_and_outer_state_round_trip_through_the_bucket(
        tmp_path_factory: Any, params: dict) -> None:
    store = open_store(f"file://{tmp_path_factory.mktemp('store')}")
    outer = OuterState(clone(params), {k: -v for k, v in params.items()})
    for key, tensors in (("p", params), ("o", outer.to_tensors())):
        size, checksum = write_state(store, key, clone(tensors), kind="params", fingerprint="f", consume=True)
        _, back = read_tensors(store, key, fingerprint="f", checksum=checksum)
        assert _same(back, tensors) and size == len(store.get(key))
    _, back = read_tensors(store, "o", checksum=None)
    assert _same(OuterState.from_tensors(back, params).residual, outer.residual)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: Any) -> Any:
    """A run whose chain the checkpoints below are written to (each under its own nonce)."""
    return create_run(open_store(f"file://{tmp_path_factory.mktemp('run')}"), "layout", load_config("tiny"))


@settings(SETTINGS, max_examples=25)
@given(params=layouts(), part_bytes=st.sampled_from([40, 1024, 1 << 20]), pending=st.booleans())
def test_a_chains_checkpoint_of_any_layout_comes_back_bit_for_bit_over_parts(
        chain: Any, params: dict, part_bytes: int, pending: bool) -> None:
    """The merger's checkpoint (issue #41): params and outer state split over parts as small as ten elements,
    a 0-d or empty tensor among them, read back bit for bit (and the params alone without the outer parts)."""
    ctx = chain
    outer = OuterState(clone(params), {k: -v for k, v in params.items()},
                       {k: v * 0.5 for k, v in params.items()} if pending else {}, 0.25 if pending else 0.0)
    ref = write_checkpoint(ctx, 3, clone(params), outer, ema={}, manifest_checksum="", created_by="t",
                           part_bytes=part_bytes)
    got = read_checkpoint(ctx, ref)
    assert _same(got.params, params) and got.outer is not None
    assert _same(got.outer.to_tensors(), outer.to_tensors())
    assert got.outer.pending_share == outer.pending_share
    assert _same(read_checkpoint(ctx, ref, outer=False).params, params)


class Holder(nn.Module):
    """A module holding exactly the given parameters (names with dots become nested modules' names)."""

    def __init__(self, params: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__()
        self.names = list(params)
        for name, value in params.items():
            self.register_parameter(name.replace(".", "_"), nn.Parameter(value.to(dtype)))

    def named(self) -> dict[str, nn.Parameter]:
        return dict(self.named_parameters())


@SETTINGS
@given(params=layouts(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_checkpoint_local_state_and_the_evaluated_model_of_any_layout(tmp_path_factory: Any, params: dict,
                                                                      dtype: torch.dtype) -> None:
    model = Holder(params, dtype)
    eps = 1e-8 if dtype == torch.float32 else 1e-3  # 1e-8 is 0 in fp16: its AdamW step would divide by 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    loss.backward()
    opt.step()
    # the checkpoint: AdamW state (0-d moments of a 0-d parameter go to the meta) through the codec, then
    # restored
    tensors, meta = export_state(opt, model.named(), step=1)
    _, back = decode_tensors(encode_tensors(tensors, codec_name="fp32", kind="state", fingerprint="f",
                                            meta=meta))
    twin = Holder(params, dtype)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3, eps=eps)
    assert import_state(twin_opt, twin.named(), back, meta) == 1
    for (_, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        for key, value in opt.state[p].items():
            assert value.shape == twin_opt.state[q][key].shape and value.dtype == twin_opt.state[q][key].dtype
            assert torch.equal(value, twin_opt.state[q][key]), key
    # the canonical fp32 params (what a learner ships and the evaluator, export and a rejoin load)
    flat = get_flat_params(model)
    assert [tuple(v.shape) for v in flat.values()] == [tuple(v.shape) for v in params.values()]
    assert all(v.dtype == torch.float32 for v in flat.values())
    assert [e["shape"] for e in model_layout(model)] == [list(v.shape) for v in params.values()]
    set_params(twin, flat)
    assert _same(get_flat_params(twin), flat)
    # the learner's local state: every part back with its shapes
    local = LocalState("file:///s", "run", "l0", 1.0, "f", root=Path(tmp_path_factory.mktemp("local")))
    local.save({"theta": flat, "ref": clone(flat), "glob": clone(flat), "opt": tensors}, {"next_seq": 3})
    local.flush()
    saved = local.load()
    local.close()
    assert saved is not None and _same(saved.parts["theta"], flat) and _same(saved.parts["opt"], tensors)


@pytest.mark.parametrize("codec", [c for c in CODECS if c in VALUES_PER_BYTE])
def test_a_one_element_tensor_changed_after_encoding_keeps_its_shipped_bytes(codec: str) -> None:
    """The merger writes the update and then turns the tensor it encoded into the residual: the object's bytes
    must not follow (a one-element fp32 stream once aliased its tensor: the update failed its crc)."""
    from diloco.storage.codec import Encoder

    for name_codec in ("fp32", "bf16", codec):
        encoder = Encoder(codec=name_codec, kind="update", fingerprint="f")
        value = np.array([0.25], np.float32)
        encoder.add("bias", value)
        value[0] = 0.0
        _, out = decode_tensors(encoder.finish())
        assert (out["bias"].numpy().tolist()
                == reference_decode(np.array([0.25], np.float32), name_codec).tolist())

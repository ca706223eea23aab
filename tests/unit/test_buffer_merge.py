"""Buffers merged by the run (diloco.training.buffers, merger/step.py): which buffers ship, the merge rule
(float: the token-weighted mean, fp64 sums; integer and bool: the maximum; nothing added: None, so the
parent's carry forward), loading values back into a model, and every way a delta's buffers are refused before
a merge sees them.

Run: .venv/bin/pytest tests/unit/test_buffer_merge.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diloco.merger.step import GradientStream, LearnerGroup
from diloco.run.objects import decode_tensors, encode_shipped
from diloco.training.buffers import BufferMerge, buffer_difference, buffer_layout, get_buffers, set_buffers
from diloco.trust.validate import DeltaInvalid, split_buffers

LAYOUT = [{"name": "bn.running_mean", "shape": [3], "dtype": "float32"},
          {"name": "bn.running_var", "shape": [3], "dtype": "float32"},
          {"name": "bn.num_batches_tracked", "shape": [], "dtype": "int64"}]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 3)
        self.bn = nn.BatchNorm1d(3)
        # rebuilt by build_model: never ships
        self.register_buffer("table", torch.arange(4.0), persistent=False)
        self.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))  # fp32 cannot carry it


def _values(mean: list[float], var: list[float], steps: int) -> dict[str, torch.Tensor]:
    return {"bn.running_mean": torch.tensor(mean), "bn.running_var": torch.tensor(var),
            "bn.num_batches_tracked": torch.tensor(float(steps))}


def test_the_persistent_buffers_ship_in_order_and_others_are_named() -> None:
    ships, cannot = buffer_layout(Model())
    assert ships == LAYOUT and cannot == ["phase (complex64)"]
    assert buffer_difference(LAYOUT, ships) is None
    assert "buffer 1 ('bn.running_var'): shape [4]" in buffer_difference(
        LAYOUT, [LAYOUT[0], {**LAYOUT[1], "shape": [4]}, LAYOUT[2]])
    assert "no buffer 'bn.num_batches_tracked'" in buffer_difference(LAYOUT, LAYOUT[:2])


def test_floats_are_the_token_weighted_mean_and_integers_the_maximum() -> None:
    merge = BufferMerge(LAYOUT)
    merge.add(100, _values([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], 7))
    merge.add(300, _values([5.0, 2.0, -1.0], [3.0, 1.0, 5.0], 4))
    out = merge.finish()
    assert torch.equal(out["bn.running_mean"], torch.tensor([4.0, 2.0, 0.0]))  # (100 x + 300 y) / 400
    assert torch.equal(out["bn.running_var"], torch.tensor([2.5, 1.0, 4.0]))
    assert out["bn.num_batches_tracked"].item() == 7.0
    assert list(out) == [e["name"] for e in LAYOUT] and all(v.dtype == torch.float32 for v in out.values())


def test_identical_values_come_back_bit_for_bit_and_nothing_added_is_none() -> None:
    values = _values([0.1, 1 / 3, 7e-9], [2.2, 1e-7, 123.456], 5)
    merge = BufferMerge(LAYOUT)
    for tokens in (3, 7, 1000003):
        merge.add(tokens, values)
    assert all(torch.equal(merge.finish()[k], values[k]) for k in values)
    assert BufferMerge(LAYOUT).finish() is None  # no learner's buffers: the parent's carry forward


def test_values_load_into_the_model_in_its_own_dtypes() -> None:
    model = Model()
    set_buffers(model, _values([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], 9), LAYOUT)
    assert model.bn.num_batches_tracked.dtype == torch.int64 and model.bn.num_batches_tracked.item() == 9
    got = get_buffers(model, LAYOUT)
    assert torch.equal(got["bn.running_var"], torch.tensor([4.0, 5.0, 6.0]))
    assert got["bn.num_batches_tracked"].dtype == torch.float32 and got["bn.num_batches_tracked"].shape == ()
    with pytest.raises(ValueError, match="shape"):
        set_buffers(model, {**got, "bn.running_mean": torch.zeros(4)}, LAYOUT)
    with pytest.raises(ValueError, match="buffers differ"):
        set_buffers(model, {"bn.running_mean": torch.zeros(3)}, LAYOUT)
    assert get_buffers(model, []) == {}


def _delta(buffers: dict[str, torch.Tensor] | None, codec: str = "int8", **meta):
    data, _ = encode_shipped({"lin.weight": torch.randn(3, 2)}, codec_name=codec, kind="delta",
                             fingerprint="f",
                             meta={"base_version": 0, "tokens": 64, "steps": 2, **meta}, buffers=buffers)
    return decode_tensors(data)


def test_a_delta_carries_its_buffers_exactly_after_its_parameters() -> None:
    values = _values([0.1, 0.2, 0.3], [1.5, 2.5, 3.5], 11)
    header, delta = _delta(values, codec="int4")
    assert header.meta["buffers"] == 3 and list(delta) == ["lin.weight", *values]
    taken = split_buffers(header, delta, LAYOUT)
    assert list(delta) == ["lin.weight"] and all(torch.equal(taken[k], values[k]) for k in values)
    group = LearnerGroup("a")  # a judged delta keeps them after its parameters: the group takes them off
    header, delta = _delta(values)
    group.add(0, header, delta)
    assert (list(group.total) == ["lin.weight"]
            and torch.equal(group.buffers["bn.running_var"], values["bn.running_var"]))
    stream = GradientStream(0, "mean", 0.5, buffers=LAYOUT)
    stream.add(group)
    assert torch.equal(stream.merged_buffers()["bn.running_mean"], values["bn.running_mean"])


def _forged(rename: str | None = None, shape: list[int] | None = None):
    """A delta whose second buffer entry is renamed or reshaped."""
    values = _values([0.0] * 3, [1.0] * 3, 1)
    if rename:
        values = {(rename if k == "bn.running_var" else k): v for k, v in values.items()}
    if shape:
        values["bn.running_var"] = torch.ones(shape)
    return _delta(values)


BAD = {
    "missing": (lambda: _delta(None), "carries 0 buffers where the run merges 3"),
    "one short": (lambda: _delta(dict(list(_values([0.0] * 3, [1.0] * 3, 1).items())[:2])),
                  "carries 2 buffers"),
    "renamed": (lambda: _forged(rename="bn.running_vor"), "buffer 1 is 'bn.running_vor'"),
    "reshaped": (lambda: _forged(shape=[4]),
                 "of shape \\[4\\], where the run has 'bn.running_var' of shape \\[3\\]"),
    "not a number": (lambda: _delta(_values([float("nan"), 0.0, 0.0], [1.0] * 3, 1)), "non-finite"),
    "infinite": (lambda: _delta(_values([0.0] * 3, [float("inf"), 1.0, 1.0], 1)), "non-finite"),
    "a fraction of a step": (lambda: _delta({**_values([0.0] * 3, [1.0] * 3, 1),
                                             "bn.num_batches_tracked": torch.tensor(2.5)}), "not integers"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_buffers_are_refused_with_a_reason(case: str) -> None:
    make, reason = BAD[case]
    header, delta = make()
    with pytest.raises(DeltaInvalid, match=reason):
        split_buffers(header, delta, LAYOUT)


def test_buffers_stored_inexactly_or_miscounted_are_refused() -> None:
    header, delta = _delta(_values([0.0] * 3, [1.0] * 3, 1))
    quantized = header.__class__(**{**header.__dict__, "tensors": tuple(
        # as if the buffers were int8 like the rest
        t.__class__(t.name, t.shape, None) for t in header.tensors)})
    with pytest.raises(DeltaInvalid, match="stored as int8, not exactly"):
        split_buffers(quantized, dict(delta), LAYOUT)
    for count in (-1, 9, "3", True):
        bad = header.__class__(**{**header.__dict__, "meta": {**header.meta, "buffers": count}})
        with pytest.raises(DeltaInvalid, match="bad header field buffers"):
            split_buffers(bad, dict(delta), LAYOUT)
    with pytest.raises(DeltaInvalid, match="where the run merges 0 \\(none\\)"):
        split_buffers(header, dict(delta), [])  # a run that merges no buffers takes none
    header, delta = _delta(None)
    assert split_buffers(header, delta, []) == {} and list(delta) == ["lin.weight"]

"""The merger's fp64 shortcuts keep the bits of the plain expressions: `sum_squares` and `add_scaled_`
against `(x.double() ** 2).sum()` and `acc.add_(x.double(), alpha=w)` over shapes across a chunk boundary;
a delta's norm through a scratch against the old norm, and non-finite exactly when a value is NaN or Inf
(the judge's finiteness check folded into it); Combiner.take_result against result.
Run: .venv/bin/pytest tests/unit/test_fp64_bits.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from diloco.training.fp64 import CHUNK_ELEMENTS, Fp64Scratch, add_scaled_, sum_squares
from diloco.training.merge import Combiner
from diloco.trust.judge import delta_norm

SHAPES = {"wte.weight": (40, 64), "h.0.w": (33, 7), "ln.b": (5,), "odd": (CHUNK_ELEMENTS + 77,)}


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


SIZES = [(), (1,), (7,), (33, 5), (3, CHUNK_ELEMENTS // 2 + 5)]


@pytest.mark.parametrize("shape", SIZES)
def test_fp64_helpers_keep_the_bits_of_the_plain_expressions(shape):
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-20, 20, shape, generator=gen).float()
    scratch = Fp64Scratch()
    assert torch.equal(sum_squares(x, scratch), (x.double() ** 2).sum())
    acc = torch.randn(shape, generator=gen, dtype=torch.float64)
    expected = acc.clone().add_(x.double(), alpha=0.123456789)
    add_scaled_(acc, x, 0.123456789, scratch)
    assert torch.equal(acc, expected)


def test_the_fused_norm_is_the_old_norm_and_non_finite_exactly_when_a_value_is():
    gen = torch.Generator().manual_seed(3)
    delta = {k: torch.randn(s, generator=gen) * 1e-3 for k, s in SHAPES.items()}
    old = float(torch.sqrt(sum((v.double() ** 2).sum() for v in delta.values())))
    assert delta_norm(delta, Fp64Scratch()) == old
    big = {"w": torch.full((4,), torch.finfo(torch.float32).max)}
    assert math.isfinite(delta_norm(big))  # the largest fp32 squared and summed: finite in fp64
    for bad in (float("nan"), float("inf"), -float("inf")):
        hostile = {k: v.clone() for k, v in delta.items()}
        hostile["odd"][CHUNK_ELEMENTS + 5] = bad
        assert not math.isfinite(delta_norm(hostile))


@pytest.mark.parametrize("rule", ["mean", "rda"])
def test_take_result_is_result(rule):
    gen = torch.Generator().manual_seed(5)
    a, b = Combiner(rule, direct=("ln.b",)), Combiner(rule, direct=("ln.b",))
    for w in (1.0, 0.25, 3.5):
        delta = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
        a.add(delta, w)
        b.add(delta, w)
    assert _same(a.take_result(), b.result())

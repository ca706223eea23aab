"""The merger's fp64 shortcuts keep the bits of the plain expressions: `sum_squares`, `add_scaled_` and
`quotient_fp32` against `(x.double() ** 2).sum()`, `acc.add_(x.double(), alpha=w)` and `(acc / d).float()`
over shapes across a chunk boundary, `sum_squares_chunked` against that sum taken chunk by chunk; a delta's
norm through a scratch against the old norm, and non-finite exactly when a value is NaN or Inf (the judge's
finiteness check folded into it), both ways; the judge sums squares as the run's trust rules say, with its
worker thread or without; Combiner.take_result against result; a combination laid in a kept arena that an
earlier one left dirty, its result written into given buffers, against fresh zeros and fresh tensors.
Run: .venv/bin/pytest tests/unit/test_fp64_bits.py -q
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from diloco.configs import load_config
from diloco.run.objects import encode_tensors
from diloco.training.fp64 import (
    CHUNK_ELEMENTS,
    NORM_CHUNK_ELEMENTS,
    Arena,
    Fp64Scratch,
    add_scaled_,
    quotient_fp32,
    sum_squares,
    sum_squares_chunked,
)
from diloco.training.merge import Combiner
from diloco.trust.guard import initial_state, policy_after
from diloco.trust.judge import Judge, delta_norm

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
    assert torch.equal(quotient_fp32(acc, 2.718281828, scratch), (acc / 2.718281828).to(torch.float32))


CHUNKED_SIZES = [(), (0,), (1,), (NORM_CHUNK_ELEMENTS,), (NORM_CHUNK_ELEMENTS + 1,),
                 (3, NORM_CHUNK_ELEMENTS - 7), (2 * NORM_CHUNK_ELEMENTS + 5,)]


@pytest.mark.parametrize("shape", CHUNKED_SIZES)
def test_a_chunked_sum_of_squares_is_the_plain_sum_chunk_by_chunk(shape):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-20, 20, shape, generator=gen).float()
    expected = torch.zeros((), dtype=torch.float64)
    for chunk in x.reshape(-1).split(NORM_CHUNK_ELEMENTS):
        expected += (chunk.double() ** 2).sum()
    assert torch.equal(sum_squares_chunked(x, Fp64Scratch()), expected)
    if x.numel() <= NORM_CHUNK_ELEMENTS:  # one chunk: the whole tensor's sum
        assert torch.equal(sum_squares_chunked(x, Fp64Scratch()), sum_squares(x, Fp64Scratch()))


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
        assert not math.isfinite(delta_norm(hostile, chunked=True))
    assert math.isfinite(delta_norm(big, chunked=True))


@pytest.mark.parametrize("threaded", [False, True])
def test_the_judge_sums_squares_by_the_run_s_rules(threaded):
    """Trust rules 4 (chunked_norms) take each tensor's squares a chunk at a time, earlier rules whole: a
    tensor of several chunks tells them apart, and audit replays each run by its own."""
    gen = torch.Generator().manual_seed(7)
    params = {"w": torch.randn(3 * NORM_CHUNK_ELEMENTS + 11, generator=gen),
              "b": torch.randn(5, generator=gen)}
    delta = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    meta = {"learner": "a", "seq": 0, "base_version": 3, "tokens": 100, "steps": 10}
    data = encode_tensors(delta, codec_name="fp32", kind="delta", fingerprint="f" * 16, meta=meta)
    whole, chunked = delta_norm(delta), delta_norm(delta, chunked=True)
    assert whole != chunked  # this delta tells the two apart (another order of summation)
    policy = policy_after(initial_state(["a"]), [], load_config("tiny"))
    for rules_chunked, expected in ((False, whole), (True, chunked)):
        with ThreadPoolExecutor(1) as worker:
            judge = Judge("r", "f" * 16, 3, params, policy, worker=worker if threaded else None,
                          chunked_norms=rules_chunked)
            d, _, _ = judge.judge("a", 0, len(data), data)
        assert d.status == "merged" and d.norm == expected, (d, expected)


@pytest.mark.parametrize("rule", ["mean", "rda"])
def test_take_result_is_result(rule):
    gen = torch.Generator().manual_seed(5)
    a, b = Combiner(rule, direct=("ln.b",)), Combiner(rule, direct=("ln.b",))
    for w in (1.0, 0.25, 3.5):
        delta = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
        a.add(delta, w)
        b.add(delta, w)
    assert _same(a.take_result(), b.result())


def test_an_arena_hands_out_views_of_one_kept_block():
    arena = Arena(torch.float64)
    first = arena.views({"a": (3, 4), "b": (5,)}, zero=True)
    assert [tuple(v.shape) for v in first.values()] == [(3, 4), (5,)] and arena.held_bytes == 17 * 8
    assert all(v.dtype == torch.float64 and v.is_contiguous() and not v.any() for v in first.values())
    assert first["b"].data_ptr() == first["a"].data_ptr() + 12 * 8  # laid one after another
    for v in first.values():
        v.fill_(float("nan"))
    again = arena.views({"c": (2, 2)}, zero=True)  # a smaller request: the same block, zeroed
    assert again["c"].data_ptr() == first["a"].data_ptr() and not again["c"].any()
    assert arena.held_bytes == 17 * 8
    grown = arena.views({"d": (40,)})  # a larger one: a new block, kept from then on
    assert arena.held_bytes == 40 * 8 and grown["d"].numel() == 40
    arena.release()
    assert arena.held_bytes == 0


@pytest.mark.parametrize("rule", ["mean", "rda"])
def test_a_combination_in_a_dirty_arena_has_the_bits_of_fresh_zeros(rule):
    """The merger's kept blocks (MergeArenas): its fp64 sums laid in a block an earlier merge left full of
    NaN, its pseudo-gradient written into buffers that held another delta — the bits of fresh zeros and a
    fresh result."""
    gen = torch.Generator().manual_seed(11)
    deltas = [({k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}, w) for w in (1.0, 0.3, 2.75)]
    arena = Arena(torch.float64)
    for v in arena.views({k: s for k, s in SHAPES.items()}).values():
        v.fill_(float("nan"))
    fresh, kept = Combiner(rule, direct=("ln.b",)), Combiner(rule, direct=("ln.b",), arena=arena)
    for delta, w in deltas:
        fresh.add({k: v.clone() for k, v in delta.items()}, w)
        kept.add({k: v.clone() for k, v in delta.items()}, w)
    buffers = {k: torch.full(s, float("nan")) for k, s in SHAPES.items()}
    where = {k: v.data_ptr() for k, v in buffers.items()}
    given = kept.take_result(into=lambda name: buffers.pop(name, None))
    assert _same(given, fresh.take_result())
    # a mean tensor's result is the buffer given; rda's is its own (the unit vector is fresh)
    mean = {k for k in SHAPES if rule == "mean" or k == "ln.b"}
    assert {k for k in SHAPES if given[k].data_ptr() == where[k]} == mean

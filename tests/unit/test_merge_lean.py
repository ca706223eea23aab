"""The merger's in-place outer step commits the bits of the plain one: `outer_step_in_place` (chunked, in
place, the update's shipment taken from the codec's stream) against `outer_step` (what `audit` replays) over
chained merges of every optimizer mode and update codec, with a tensor of two chunks and version 0's zeros.
Run: .venv/bin/pytest tests/unit/test_merge_lean.py -q
"""

from __future__ import annotations

import itertools

import pytest
import torch

from diloco.configs import load_config
from diloco.merger.inplace import outer_step_in_place
from diloco.merger.step import LearnerGroup, OuterState, gradient_stream, outer_optimizer, outer_step
from diloco.training.fp64 import CHUNK_ELEMENTS

M = 3
BASE = load_config("tiny").with_overrides({"run.num_learners": M, "outer.lr": 0.7, "outer.momentum": 0.9})
H = BASE.inner.steps_per_phase
# odd: 2 chunks
SHAPES = {"wte.weight": (40, 64), "h.0.w": (33, 7), "ln.b": (5,), "odd": (CHUNK_ELEMENTS + 77,)}
MERGES = [[("a", H, 0)], [("a", H, 0), ("b", 2 * H, 1)], [], [("c", 7, 0)],
          [("a", 5 * H, 0), ("b", H, 0), ("c", H, 2)], [("a", H, 0), ("b", H, 0), ("c", H, 0)]]


def _stream(params, version, cfg, gen, spec):
    stream = gradient_stream(params, version, cfg.outer)
    for name, steps, stale in spec:
        delta = {k: torch.randn(s, generator=gen) * 0.05 for k, s in SHAPES.items()}
        stream.add(LearnerGroup(name, seqs=[0], tokens=steps * 64, steps=steps,
                                min_base=max(0, version - stale), total=delta))
    return stream


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


CASES = [*itertools.product(("merge", "round", "delayed"), ("fp32", "int8", "int4")),
         ("merge", "bf16"), ("merge", "int3"), ("merge", "int2"), ("merge", "nf2"),
         ("rda", "int8"), ("whole", "int8"), ("no-partial", "int4"), ("no-nesterov", "int8")]
VARIANTS = {"rda": {"outer.merge_rule": "rda"}, "whole": {"experimental.backlog_momentum": "whole"},
            "no-partial": {"outer.partial_scaling": False}, "no-nesterov": {"outer.nesterov": False}}


@pytest.mark.parametrize("mode,codec", CASES)
def test_the_in_place_step_commits_the_bits_of_outer_step(mode, codec):
    overrides = VARIANTS.get(mode, {"experimental.momentum_per": mode})
    cfg = BASE.with_overrides({**overrides, "outer.update_codec": codec})
    gen = torch.Generator().manual_seed(7)
    params = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    ref_p, ref_o = params, OuterState.zeros_like(params)
    lean_p, lean_o = {k: v.clone() for k, v in params.items()}, None  # None: version 0's zeros
    for version, spec in enumerate(MERGES):
        seed = int(torch.randint(1 << 30, (1,), generator=gen))
        ref = outer_step(ref_p, ref_o, _stream(ref_p, version, cfg, torch.Generator().manual_seed(seed),
                                               spec),
                         "fp", outer_optimizer(cfg, M))
        lean = outer_step_in_place(lean_p, lean_o, _stream(lean_p, version, cfg,
                                                           torch.Generator().manual_seed(seed), spec),
                                   "fp", outer_optimizer(cfg, M))
        assert lean.update_bytes == ref.update_bytes
        assert _same(lean.params, ref.params)
        assert _same(lean.outer.to_tensors(), ref.outer.to_tensors())  # the .outer object's names and bits
        assert lean.outer.pending_share == ref.outer.pending_share
        assert (lean.weights, lean.update_norm, lean.scale) == (ref.weights, ref.update_norm, ref.scale)
        ref_p, ref_o = ref.params, ref.outer
        lean_p, lean_o = lean.params, OuterState(dict(lean.outer.momentum), dict(lean.outer.residual),
                                                 dict(lean.outer.pending), lean.outer.pending_share)

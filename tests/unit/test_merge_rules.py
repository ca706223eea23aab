"""Merge rules: delta weights with staleness, weighted mean, radial-directional averaging (RDA).

Fast (well under a second). Run: .venv/bin/pytest tests/unit/test_merge_rules.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from diloco.training.merge import Combiner, delta_weight

DIM = 4096  # random vectors this long are nearly orthogonal


def _random_deltas(num: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(DIM, generator=gen),
             "emb": torch.randn(8, 4, generator=gen)} for _ in range(num)]


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


def test_delta_weight_formula():
    assert delta_weight(1000, 10, 0, 0.5) == pytest.approx(1000 * 100)
    assert delta_weight(1000, 10, 3, 0.5) == pytest.approx(1000 * 100 / 2)
    assert delta_weight(1000, 10, 3, 0.0) == pytest.approx(1000 * 100)
    assert delta_weight(500, 10, 0, 1.0) < delta_weight(1000, 20, 0, 1.0)  # same tokens/step, fewer tokens
    assert delta_weight(1000, 20, 0, 1.0) < delta_weight(1000, 10, 0, 1.0)  # same tokens, lower quality
    assert delta_weight(0, 10, 0, 0.5) == 0.0 and delta_weight(10, 0, 0, 0.5) == 0.0
    with pytest.raises(ValueError):
        delta_weight(-1, 10, 0, 0.5)


def test_mean_with_equal_weights_is_the_average():
    deltas = _random_deltas(3)
    combiner = Combiner("mean")
    for d in deltas:
        combiner.add(d, 2.5)
    out = combiner.result()
    for name in ("w", "emb"):
        want = sum(d[name].double() for d in deltas) / 3
        assert out[name].dtype == torch.float32
        torch.testing.assert_close(out[name], want.float())


def test_weighted_mean():
    combiner = Combiner("mean")
    combiner.add({"x": torch.tensor([1.0])}, 1.0)
    combiner.add({"x": torch.tensor([4.0])}, 3.0)
    out = combiner.result()
    assert out["x"].item() == pytest.approx(3.25)


@pytest.mark.parametrize("num", [1, 16])
def test_rda_keeps_the_norm_mean_shrinks_it(num: int):
    deltas = _random_deltas(num)
    rda, mean = Combiner("rda", direct=("emb",)), Combiner("mean")
    for d in deltas:
        rda.add(d, 1.0)
        mean.add(d, 1.0)
    rda_out, mean_out = rda.result(), mean.result()
    mean_of_norms = sum(_norm(d["w"]) for d in deltas) / num
    assert _norm(rda_out["w"]) == pytest.approx(mean_of_norms, rel=1e-5)
    assert _norm(mean_out["w"]) == pytest.approx(mean_of_norms / math.sqrt(num), rel=0.1)
    torch.testing.assert_close(rda_out["emb"], mean_out["emb"])  # direct tensors use the mean
    cos = torch.nn.functional.cosine_similarity(rda_out["w"], mean_out["w"], dim=0)
    assert cos.item() > 0.999  # RDA only rescales here: equal weights, so direction = mean direction


def test_rda_zero_delta_is_guarded():
    combiner = Combiner("rda")
    combiner.add({"x": torch.zeros(4)}, 1.0)
    combiner.add({"x": torch.zeros(4)}, 1.0)
    out = combiner.result()
    assert torch.equal(out["x"], torch.zeros(4))


def test_streaming_is_deterministic_given_the_order():
    deltas = _random_deltas(5, seed=3)
    weights = [1.0, 7.0, 0.5, 3.0, 2.0]

    def run(rule: str) -> dict[str, torch.Tensor]:
        c = Combiner(rule, direct=("emb",))
        for d, w in zip(deltas, weights, strict=True):
            c.add(d, w)
        return c.result()

    for rule in ("mean", "rda"):
        a, b = run(rule), run(rule)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_inputs_raise_and_change_nothing():
    combiner = Combiner("mean")
    with pytest.raises(ValueError, match="no deltas"):
        combiner.result()
    combiner.add({"x": torch.ones(3)}, 1.0)
    for bad_weight in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weight"):
            combiner.add({"x": torch.ones(3)}, bad_weight)
    with pytest.raises(ValueError, match="shape"):
        combiner.add({"x": torch.ones(4)}, 1.0)
    with pytest.raises(ValueError, match="names differ"):
        combiner.add({"y": torch.ones(3)}, 1.0)
    assert combiner.num_added == 1 and torch.equal(combiner.result()["x"], torch.ones(3))
    with pytest.raises(ValueError, match="rule"):
        Combiner("median")
    zero = Combiner("mean")
    zero.add({"x": torch.ones(3)}, 0.0)
    with pytest.raises(ValueError, match="zero"):
        zero.result()

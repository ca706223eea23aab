"""Fragment layout: deterministic LPT packing, balance bound, every element covered once, P = 1 is the whole
model; the config keys fragments.count / overlap_steps / merger.shards validated with errors naming them; the
fragment keys live under fragments/<p:04d>/ and the root chain's keys are unchanged.

Run: .venv/bin/pytest tests/unit/test_fragments_layout.py -q
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from diloco.configs import ConfigError, load_config
from diloco.run.fragments import plan_for
from diloco.storage.keys import RunKeys, parse_delta_key, parse_manifest_key
from diloco.training.fragments import (
    FragmentError,
    due_offset,
    fragment_layout,
    owned_by,
    plan_fragments,
    put_,
    take,
)
from diloco.training.model import GPT
from diloco.training.spec import model_layout


def _gpt_layout(n_layer: int = 2, d_model: int = 64) -> list[dict]:
    cfg = load_config("tiny").with_overrides({"model.n_layer": n_layer, "model.d_model": d_model})
    torch.manual_seed(0)
    return model_layout(GPT(cfg.model))


def _random_layout(rng: random.Random) -> list[dict]:
    return [{"name": f"t{i}", "shape": [rng.randint(1, 40), rng.randint(1, 9)], "dtype": "float32",
             "direct": rng.random() < 0.1} for i in range(rng.randint(1, 30))]


def _coverage(layout: list[dict], plan: list[dict]) -> dict[str, list[int]]:
    """Per tensor, how many fragments cover each row (every element of a row goes with its row)."""
    counts = {e["name"]: [0] * (e["shape"][0] if e["shape"] else 1) for e in layout}
    for fragment in plan:
        for p in fragment["pieces"]:
            rows = p["rows"] or [0, len(counts[p["name"]])]
            for r in range(*rows):
                counts[p["name"]][r] += 1
    return counts


def test_one_fragment_is_the_whole_model_in_order():
    layout = _gpt_layout()
    (only,) = plan_fragments(layout, 1)
    assert [p["key"] for p in only["pieces"]] == [e["name"] for e in layout]
    assert all(p["rows"] is None for p in only["pieces"])
    assert plan_for(1, layout) == []  # run.json records nothing: the root chain, as before fragments


@pytest.mark.parametrize("count", [2, 3, 4, 7, 12, 24])
def test_gpt_plan_is_deterministic_balanced_and_covers_every_element_once(count):
    layout = _gpt_layout(n_layer=4)
    plan = plan_fragments(layout, count)
    assert plan == plan_fragments(layout, count)
    assert len(plan) == count and all(f["pieces"] for f in plan)
    for counts in _coverage(layout, plan).values():
        assert set(counts) == {1}
    total = sum(math.prod(e["shape"]) for e in layout)
    biggest = max(p["numel"] for f in plan for p in f["pieces"])
    assert biggest <= math.ceil(total / count) or all(p["rows"] is None for f in plan for p in f["pieces"]
                                                      if p["numel"] == biggest)
    assert max(f["numel"] for f in plan) <= total / count + biggest  # LPT's bound
    assert sum(f["numel"] for f in plan) == total


def test_random_layouts_cover_once_and_respect_the_bound():
    rng = random.Random(7)
    for _ in range(200):
        layout = _random_layout(rng)
        count = rng.randint(1, 12)
        try:
            plan = plan_fragments(layout, count)
        except FragmentError as err:
            assert "fragments.count" in str(err)
            continue
        for counts in _coverage(layout, plan).values():
            assert set(counts) == {1}
        total = sum(f["numel"] for f in plan)
        biggest = max(p["numel"] for f in plan for p in f["pieces"])
        assert max(f["numel"] for f in plan) <= total / count + biggest


def test_take_and_put_round_trip_with_row_splits():
    layout = [{"name": "emb", "shape": [10, 3], "dtype": "float32", "direct": True},
              {"name": "b", "shape": [2], "dtype": "float32", "direct": False}]
    plan = plan_fragments(layout, 3)
    assert any(p["rows"] for f in plan for p in f["pieces"])
    params = {"emb": torch.arange(30.0).reshape(10, 3), "b": torch.tensor([1.0, 2.0])}
    rebuilt = {k: torch.zeros_like(v) for k, v in params.items()}
    for fragment in plan:
        part = take(params, fragment)
        assert [e["name"] for e in fragment_layout(fragment)] == list(part)
        assert all(list(part[e["name"]].shape) == e["shape"] for e in fragment_layout(fragment))
        put_(rebuilt, fragment, part)
    assert all(torch.equal(rebuilt[k], params[k]) for k in params)
    emb_pieces = [p for f in plan for p in f["pieces"] if p["name"] == "emb"]
    assert all(p["direct"] for p in emb_pieces)  # the embedding's rows keep direct averaging


def test_too_many_fragments_is_an_error_naming_the_key():
    layout = [{"name": "a", "shape": [1], "dtype": "float32"},
              {"name": "b", "shape": [1], "dtype": "float32"}]
    with pytest.raises(FragmentError, match="fragments.count"):
        plan_fragments(layout, 3)
    with pytest.raises(ConfigError, match="fragments.count"):
        plan_for(3, layout)


def test_config_keys_are_validated_naming_the_field():
    cfg = load_config("tiny")
    assert cfg.fragments.count == 1 and cfg.merger.shards == 1
    ok = cfg.with_overrides({"fragments.count": 4, "merger.shards": 2})
    assert ok.fragments.overlap_steps == 2
    with pytest.raises(ConfigError, match="fragments.count"):
        cfg.with_overrides({"fragments.count": 0})
    with pytest.raises(ConfigError, match="merger.shards"):
        cfg.with_overrides({"fragments.count": 2, "merger.shards": 3})
    with pytest.raises(ConfigError, match="fragments.overlap_steps"):
        cfg.with_overrides({"fragments.count": 2, "fragments.overlap_steps": cfg.inner.steps_per_phase})


def test_shards_and_schedule():
    assert owned_by(0, 2, 5) == [0, 2, 4] and owned_by(1, 2, 5) == [1, 3]
    with pytest.raises(FragmentError, match="merger shard"):
        owned_by(2, 2, 5)
    assert [due_offset(p, 4, 20) for p in range(4)] == [0, 5, 10, 15]


def test_fragment_keys_and_root_keys():
    root, frag = RunKeys("r1"), RunKeys("r1").for_fragment(3)
    assert root.manifest(2) == "r1/versions/00000000000000000002.json"
    assert root.delta("a-0", 1) == "r1/deltas/a-0/000000000001.delta"
    assert frag.manifest(2) == "r1/fragments/0003/versions/00000000000000000002.json"
    assert frag.delta("a-0", 1) == "r1/fragments/0003/deltas/a-0/000000000001.delta"
    assert frag.params(1, "abcdef01").startswith("r1/fragments/0003/global/")
    assert frag.status("a-0") == root.status("a-0") and frag.run_json() == root.run_json()
    assert parse_manifest_key(frag.manifest(2)) == 2 and parse_delta_key(frag.delta("a-0", 1)) == ("a-0", 1)
    assert not frag.deltas_prefix().startswith(root.deltas_prefix())


"""`diloco bench outage` end to end on the tiny recipe: no version is committed while the merger is
down, the next merge takes the backlog, both momentum rules are reported, and the bench runs without a
prefetcher.
Run: .venv/bin/pytest tests/integration/test_bench_outage.py -q
"""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from diloco.bench.outage import rule_config
from diloco.cli import app
from diloco.configs import load_config


def test_bench_outage_reports_both_rules(tmp_path):
    out, recipe = tmp_path / "outage.json", tmp_path / "tiny-momentum.yaml"
    # the rules differ by momentum
    cfg = load_config("tiny").with_overrides({"outer.lr": 0.7, "outer.momentum": 0.9})
    recipe.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["bench", "outage", "--config", str(recipe), "--at", "1", "--down", "2",
                                      "--rounds", "4", "--jobs", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["rules"]) == {"whole", "round_rate"}
    for rule in data["rules"].values():
        versions = [v for _, v, _ in rule["curve"]]
        assert versions == [1, 1, 1, 2]  # rounds 1 and 2 merge nothing; round 3 merges the backlog
    whole, spread = data["rules"]["whole"]["curve"], data["rules"]["round_rate"]["curve"]
    assert [loss for *_, loss in whole[:3]] == [loss for *_, loss in spread[:3]]  # the same run until then
    assert whole[3][2] != spread[3][2]  # the backlog merge is where the rules part


def test_bench_outage_refuses_an_outage_past_the_end():
    result = CliRunner().invoke(app, ["bench", "outage", "--at", "5", "--down", "5", "--rounds", "8"])
    assert result.exit_code == 2 and "--rounds" in result.output


def test_bench_outage_runs_the_recipe_without_its_prefetcher():
    # the bench recipe prefetches; a prefetcher installs whenever its background fetch lands, so the bench's
    # curves would depend on timing: the probe fetches instead (the same run every time)
    cfg = rule_config(load_config("bench").with_overrides({"learner.prefetch": True}), "whole", rounds=4)
    assert not cfg.learner.prefetch and cfg.merger.quorum == cfg.run.num_learners
    assert cfg.inner.total_steps == 4 * cfg.inner.steps_per_phase
    assert cfg.experimental.backlog_momentum == "whole"

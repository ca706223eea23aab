"""`diloco bench quality --quick --methods dp,streaming-int4,streaming-alt-int4,streaming-hetero-int4,
streaming-clock-int4,streaming-clock-hetero-int4,streaming-clock-hetero-dylu`: the streaming rows (4
fragments, tau 2, the sharded merger; every learner in step, two cohorts taking turns or computing at once on
the clock, or half the learners 2x slower, in turns or on the clock, with one H or each learner's from its
speed) train at equal tokens with data-parallel, lower the held-out loss and ship int4 fragments; the cohorts
merge each fragment twice as often; the slow half ships fewer fragments than the fast half, unless its H is
from its speed. tau is the recipe's fragments.overlap_steps (2 unless a --config sets it).

Run: .venv/bin/pytest tests/integration/test_bench_streaming.py -q
"""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from diloco.cli import app
from diloco.configs.schema import RECIPE_DIR


def test_streaming_row_at_equal_tokens(tmp_path):
    out = tmp_path / "q.json"
    result = CliRunner().invoke(app, ["bench", "quality", "--quick", "--methods",
                                      "dp,streaming-int4,streaming-alt-int4,streaming-hetero-int4,streaming-clock-int4,"
                                      "streaming-clock-hetero-int4,streaming-clock-hetero-dylu",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    methods = json.loads(out.read_text())["methods"]
    streaming = ("streaming-int4", "streaming-alt-int4", "streaming-hetero-int4", "streaming-clock-int4",
                 "streaming-clock-hetero-int4", "streaming-clock-hetero-dylu")
    assert set(methods) == {"dp", *streaming}
    for name in streaming:
        row = methods[name]
        assert methods["dp"]["tokens"] == row["tokens"], name
        curve = row["seeds"][0]["curve"]
        assert curve[0][0] == 0 and curve[-1][0] == row["tokens"] and curve[-1][1] < curve[0][1], name
        assert 0 < row["bytes_sent_per_learner"] < methods["dp"]["bytes_sent_per_learner"], name
    in_step, cohorts = (methods[n]["seeds"][0] for n in ("streaming-int4", "streaming-alt-int4"))
    assert cohorts["fragment_merges"] == 2 * in_step["fragment_merges"] > 0  # half the learners per merge
    # on the clock every learner computes every tick: each ships every fragment of each of its phases,
    # the second cohort's schedule half a phase later (its last half phase ships at the end), a cohort's
    # deltas per merge
    clock = methods["streaming-clock-int4"]["seeds"][0]
    assert clock["fragment_merges"] >= cohorts["fragment_merges"]
    assert max(clock["sent_per_learner"]) < 1.6 * min(clock["sent_per_learner"])
    fast_a, fast_b, slow_a, slow_b = methods["streaming-clock-hetero-int4"]["seeds"][0]["sent_per_learner"]
    assert max(slow_a, slow_b) < 0.8 * min(fast_a, fast_b)  # on the clock the slow half steps every
    # other tick. DyLU: the slow half's H is half the fast half's, so it ships each fragment as often
    # (half the steps in each)
    fast_a, fast_b, slow_a, slow_b = methods["streaming-clock-hetero-dylu"]["seeds"][0]["sent_per_learner"]
    assert min(slow_a, slow_b) > 0.8 * min(fast_a, fast_b)
    fast_a, fast_b, slow_a, slow_b = methods["streaming-hetero-int4"]["seeds"][0]["sent_per_learner"]
    assert max(slow_a, slow_b) < 0.7 * min(fast_a, fast_b)  # the slow half phases every other round


def test_streaming_rows_take_tau_from_the_recipe(tmp_path):
    """fragments.overlap_steps in the recipe (--config V.yaml) is the drives' tau, so a tau screen is a
    command."""
    recipe = yaml.safe_load((RECIPE_DIR / "bench.yaml").read_text())
    finals = {}
    for tau in (1, 2):
        path = tmp_path / f"tau{tau}.yaml"
        path.write_text(yaml.safe_dump({**recipe, "fragments": {"overlap_steps": tau}}))
        out = tmp_path / f"q{tau}.json"
        result = CliRunner().invoke(app, ["bench", "quality", "--quick", "--methods", "streaming-clock-int4",
                                          "--config", str(path), "--json", str(out)])
        assert result.exit_code == 0, result.output
        row = json.loads(out.read_text())["methods"]["streaming-clock-int4"]["seeds"][0]
        assert row["overlap_steps"] == tau
        finals[tau] = row["curve"][-1][1]
    assert finals[1] != finals[2]  # a learner installs a merge one step after its ship instead of two

"""The goodput simulator against closed forms, the paper's Table 1 (±3 points), and the CLI's JSON.

Run: .venv/bin/pytest tests/unit/test_sim.py -q   (the whole table takes a few seconds)
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from diloco.cli import app
from diloco.sim.model import SimConfig, cluster_mtbf_s
from diloco.sim.strategies import (
    STRATEGIES,
    quorum_efficiency,
    simulate_decoupled,
    simulate_dp,
    simulate_elastic_dp,
    simulate_strategy,
)
from diloco.sim.table import CHIPS, PAPER_TABLE, max_abs_error_points, run_table

SMALL = SimConfig(num_failures=20_000)


def test_cluster_mtbf_is_26_seconds_at_1_2m_chips() -> None:
    assert cluster_mtbf_s(SimConfig(), 1_200_000) == pytest.approx(26.28, abs=0.01)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_failures_is_full_goodput(strategy: str) -> None:
    assert simulate_strategy(strategy, 1_200_000, SimConfig(mtbf_chip_s=math.inf)) == 1.0


def test_restart_only_unit_matches_exponential_availability() -> None:
    """Free checkpoints, no rollback: availability = MTBF / (MTBF + detect + restart)."""
    cfg = SMALL.with_(checkpoint_write_s=0.0, detect_s=5.0, restart_s=45.0)
    mtbf = cluster_mtbf_s(cfg, 600_000)
    expected = mtbf / (mtbf + 50.0)
    assert simulate_dp(600_000, cfg, seed=3) == pytest.approx(expected, abs=0.01)


def test_dp_rollback_matches_young_first_order() -> None:
    """With a Young interval T: goodput = 1 / (1 + d/T + (D + T/2) / MTBF) for Poisson failures."""
    cfg = SMALL
    mtbf = cluster_mtbf_s(cfg, 300_000)
    interval = math.sqrt(2 * cfg.checkpoint_write_s * mtbf)
    recovery = cfg.detect_s + cfg.restart_s
    expected = 1 / (1 + cfg.checkpoint_write_s / interval + (recovery + interval / 2) / mtbf)
    assert simulate_dp(300_000, cfg, seed=1) == pytest.approx(expected, abs=0.01)


def test_single_replica_elastic_unit_matches_closed_form() -> None:
    """One replica: up Exp(MTBF), then down until repaired and rejoined."""
    cfg = SMALL.with_(chips_per_replica=10_000, repair_s=300.0)
    mtbf = cluster_mtbf_s(cfg, 10_000)
    down = max(cfg.detect_s + cfg.reshard_s, cfg.repair_s + cfg.scaleup_wait_s) + cfg.rejoin_s
    assert simulate_elastic_dp(10_000, cfg, seed=2) == pytest.approx(mtbf / (mtbf + down), abs=0.01)


def test_one_restart_learner_is_exactly_data_parallel() -> None:
    dp = simulate_dp(1_200_000, SMALL, seed=7)
    one = simulate_decoupled(1_200_000, 1, SMALL, seed=7, learner_recovery="restart")
    assert one == dp


def test_one_elastic_learner_is_exactly_elastic_data_parallel() -> None:
    assert simulate_decoupled(600_000, 1, SMALL, seed=5) == simulate_elastic_dp(600_000, SMALL, seed=5)


def test_more_learners_never_hurt_and_failures_always_cost() -> None:
    goodput = [simulate_decoupled(1_200_000, m, SMALL, seed=0) for m in (1, 2, 4, 8, 16)]
    assert all(a < b for a, b in zip(goodput, goodput[1:], strict=False))
    assert simulate_dp(1_200_000, SMALL) < goodput[0] < 1.0


def test_quorum_of_one_never_blocks_and_full_quorum_waits_for_the_slowest() -> None:
    rng = np.random.default_rng(0)
    assert quorum_efficiency(8, 1, 0.1, rng) == 1.0
    full = quorum_efficiency(8, 8, 0.1, rng)
    assert 0.8 < full < 0.9  # mean / max of 8 lognormal(0, 0.1) is about 0.87


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(ValueError, match="restart_s"):
        SimConfig(restart_s=-1.0)
    with pytest.raises(ValueError, match="strategy"):
        simulate_strategy("ring", 1000, SMALL)
    with pytest.raises(ValueError, match="learner_recovery"):
        simulate_decoupled(1000, 2, SMALL, learner_recovery="reboot")


def test_table_reproduces_the_paper_within_three_points() -> None:
    goodput = run_table(SimConfig(), seed=0)
    assert set(goodput) == set(PAPER_TABLE)
    assert all(len(goodput[s]) == len(CHIPS) for s in goodput)
    assert max_abs_error_points(goodput) <= 3.0


def test_cli_writes_valid_json(tmp_path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, ["simulate-goodput", "--json", str(out), "--num-failures", "2000"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["chips"] == [150000, 300000, 600000, 1200000, 2400000]
    assert set(report["goodput"]) == {"dp", "elastic_dp", "m2", "m4", "m8", "m16"}
    assert all(0.0 <= g <= 1.0 for row in report["goodput"].values() for g in row)
    assert "assumptions" in report and "max_abs_error_points" in report


def test_cli_rejects_a_bad_option_and_writes_nothing(tmp_path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, ["simulate-goodput", "--json", str(out), "--restart-s", "-5"])
    assert result.exit_code == 2
    assert not out.exists()

"""`bench wan`'s arithmetic: the paper-equivalent cap, the modelled ring all-reduce, time to target, the
second cohort's phase plan, the DiLoCo methods' steps and speedup past equal tokens, step padding, the
torchft row's clock, the concurrent clock's cohorts and the engine overrides of each schedule (sync;
decoupled as the recipe ships it; two cohorts); `--caps` refused when malformed, before anything runs.
Run: `.venv/bin/pytest tests/unit/test_bench_wan.py`.
"""

from __future__ import annotations

import time

import pytest

from diloco.bench._concurrent import clocked
from diloco.bench._quality_runs import quorum_of, speeds_of
from diloco.bench._wan_runs import PaddedSteps, WanRun, engine_overrides, phase_plan
from diloco.bench.peer_torchft import wan_entry
from diloco.bench.throttle import LinkSpec
from diloco.bench.wan import (
    COMM_OVER_COMPUTE,
    allreduce_s,
    bench_wan,
    default_cap_mb_s,
    diloco_steps,
    first_below,
    parse_cap_factors,
    speedups,
)
from diloco.configs import ConfigError, load_config


def test_default_cap_makes_dp_comm_the_papers_multiple_of_compute() -> None:
    n, m, step_s = 119_424, 4, 0.05
    cap = default_cap_mb_s(n, m, step_s)
    dp_bytes = 2 * (m - 1) / m * 4 * n
    assert cap == pytest.approx(dp_bytes / (COMM_OVER_COMPUTE * step_s) / 1e6)
    assert pytest.approx(198 / 5) == COMM_OVER_COMPUTE
    link = LinkSpec.symmetric(cap)
    assert allreduce_s(4 * n, link, m) == pytest.approx(COMM_OVER_COMPUTE * step_s)


def test_allreduce_adds_hops_of_latency() -> None:
    link = LinkSpec(1e6, 2e6, rtt_s=0.01)  # the slower direction sets the rate
    assert allreduce_s(1e6, link, 4) == pytest.approx(1.5 + 3 * 0.01)


def test_first_below() -> None:
    curve = [(0.0, 5.0), (1.0, 3.0), (2.0, 2.4), (3.0, 2.6), (4.0, 2.3)]
    assert first_below(curve, 2.5) == 2.0 and first_below(curve, 2.0) is None


def test_second_cohort_starts_with_half_a_phase_and_keeps_equal_steps() -> None:
    assert phase_plan(200, 40, False) == [40] * 5
    plan = phase_plan(200, 40, True)
    assert plan == [20, 40, 40, 40, 40, 20] and sum(plan) == 200


def test_tokens_factor_gives_the_diloco_methods_whole_phases() -> None:
    assert diloco_steps(2000, 1.0, 40) == 2000  # equal tokens, the contract's default
    assert diloco_steps(2000, 1.5, 40) == 3000
    assert diloco_steps(2000, 1.26, 40) == 2520  # 63 phases
    for bad in (0.5, 0.99, 11.0):
        with pytest.raises(ConfigError, match="--tokens-factor must be between 1 and 10"):
            diloco_steps(2000, bad, 40)


def test_speedup_past_equal_tokens_is_not_the_issues_speedup() -> None:
    assert speedups(2478.0, 100.0, 1.0) == {"speedup_vs_dp": 24.78, "speedup_vs_dp_past_equal_tokens": None}
    assert speedups(2478.0, 100.0, 1.5) == {"speedup_vs_dp": None, "speedup_vs_dp_past_equal_tokens": 24.78}
    assert speedups(2478.0, None, 1.0) == {"speedup_vs_dp": None, "speedup_vs_dp_past_equal_tokens": None}


def test_padded_steps_last_at_least_the_step_time() -> None:
    class Trainer:
        def train_step(self, x, y):
            return 1.0

    trainer = Trainer()
    padded = PaddedSteps(trainer, 0.02)
    t0 = time.perf_counter()
    assert trainer.train_step(None, None) == 1.0
    assert time.perf_counter() - t0 >= 0.02 and padded.steps == 1 and padded.compute_s >= 0.02 > padded.real_s


def test_torchft_row_pays_each_sync_on_the_modelled_clock() -> None:
    run = {"steps": 80, "syncs": 2, "allreduce_payload_bytes_per_learner": 2e6, "final_loss": 2.0,
           "bytes_per_learner_ring_model": 3e6, "curve": [(0, 5.0), (40, 3.0), (80, 2.0)]}
    link = LinkSpec.symmetric(1.0, rtt_s=0.0)
    entry = wan_entry(run, 0.1, link, 4, target=2.5)
    sync_s = allreduce_s(1e6, link, 4)
    assert entry["sync_s"] == pytest.approx(sync_s)
    assert entry["time_to_target_s"] == pytest.approx(80 * 0.1 + 2 * sync_s)
    assert entry["busy_mean"] == pytest.approx(8.0 / (8.0 + 2 * sync_s))


def test_clock_cohorts_and_speeds() -> None:
    assert speeds_of("concurrent", 4) == [1.0] * 4
    assert speeds_of("concurrent-hetero", 4) == [1.0, 1.0, 0.5, 0.5]
    clocks = clocked([object()] * 4, [1.0] * 4, [40] * 4, tick=10)  # type: ignore[list-item]
    assert [c.phase_left for c in clocks] == [40, 20, 40, 20]
    with pytest.raises(ValueError, match="multiple of the tick"):
        clocked([object()], [1.0], [15], tick=10)  # type: ignore[list-item]


def test_clock_full_schedule_is_in_step_with_quorum_m() -> None:
    assert speeds_of("concurrent-full", 4) == [1.0] * 4
    assert quorum_of("concurrent-full", 4) == 4 and quorum_of("concurrent", 4) == 2
    clocks = clocked([object()] * 4, [1.0] * 4, [40] * 4, tick=10, stagger=False)  # type: ignore[list-item]
    assert [c.phase_left for c in clocks] == [40] * 4


def test_engine_overrides_per_schedule() -> None:
    cfg = load_config("bench")
    m, link = cfg.run.num_learners, LinkSpec.symmetric(1.0)
    sync = engine_overrides(cfg, WanRun("s", "sync", link, 0.01, 40))
    assert sync["merger.quorum"] == m and sync["merger.grace_cap_s"] == 0.0 and sync["learner.mode"] == "sync"
    shipped = engine_overrides(cfg, WanRun("d", "carry", link, 0.01, 40))
    assert not {"merger.quorum", "merger.grace_cap_s", "learner.prefetch"} & set(shipped)  # the recipe's own
    merged = cfg.with_overrides(shipped)
    assert merged.merger.quorum == cfg.merger.quorum and merged.learner.prefetch == cfg.learner.prefetch
    cohorts = engine_overrides(cfg, WanRun("c", "carry", link, 0.01, 40, cohorts=True))
    assert cohorts["merger.quorum"] == max(1, m // 2) and cohorts["merger.grace_cap_s"] == 0.0


def test_cap_factors_are_parsed_and_bad_ones_refused_before_anything_runs() -> None:
    assert parse_cap_factors("1,2,0.5") == (1.0, 2.0, 0.5) and parse_cap_factors("0.25") == (0.25,)
    with pytest.raises(ConfigError, match="comma-separated numbers"):
        parse_cap_factors("1,two")
    for bad in ("0", "1,-2", "1e3"):
        with pytest.raises(ConfigError, match="--caps must be"):  # (checked before the DP run or any learner)
            bench_wan(quick=True, peer=False, caps=bad)

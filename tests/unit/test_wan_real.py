"""`bench wan --links real`'s arithmetic, without links: tbf's parameters at a cap, data-parallel's entry from
a measurement (time to target = steps to target x the measured step; bytes = kernel bytes per step x steps), a
DiLoCo row's kernel fields beside the application's and the overhead per request, and what a cut did to DP and
to a row. Run: `.venv/bin/pytest tests/unit/test_wan_real.py`.
"""

from __future__ import annotations

import pytest

from diloco.bench._wan_real import cut_fields, dp_cut_fields, dp_entry, kernel_fields
from diloco.bench._wan_runs import LearnerReport, WanResult
from diloco.bench.links import tbf_args


def test_tbf_holds_a_frame_or_4_ms_and_queues_200_ms() -> None:
    assert tbf_args(0.45) == ["tbf", "rate", "3600000bit", "burst", "1800", "limit", "90000"]
    assert tbf_args(0.1)[4] == "1514" and tbf_args(0.01)[6] == str(4 * 1514)  # at least a frame / four frames


def test_dp_time_to_target_is_its_steps_to_target_times_the_measured_step() -> None:
    curve = [(0, 5.0), (100, 3.0), (200, 2.0), (300, 1.9)]
    measured = {"step_s": [[2.0, 2.2], [2.1, 2.1]],
                "kernel": [{"sent": 1_500_000, "received": 1_600_000},
                           {"sent": 1_520_000, "received": 1_480_000}]}
    entry = dp_entry(curve, measured, compute_step_s=0.05, steps=300, target=2.05)
    assert entry["steps_to_target"] == 200 and entry["step_s"] == pytest.approx(2.1)
    assert (entry["time_to_target_s"] == pytest.approx(200 * 2.1)
            and entry["wall_s"] == pytest.approx(300 * 2.1))
    assert entry["kernel_bytes_sent"] == pytest.approx([750_000 * 300, 760_000 * 300])
    assert entry["kernel_bytes_received_per_learner"] == pytest.approx((800_000 + 740_000) / 2 * 300)
    assert entry["busy_mean"] == pytest.approx(0.05 / 2.1) and not entry["modelled"]
    assert dp_entry(curve, measured, 0.05, 300, target=1.0)["time_to_target_s"] is None


def _report(name: str, up: int, down: int, requests: int, phase_ends: list[float]) -> LearnerReport:
    return LearnerReport(name, 9.0, 9.0, 100, 0.0, 10.0, 0,
                         {"bytes_up": up, "bytes_down": down, "requests": requests},
                         {"delta": up}, {"global": down}, phase_ends)


def test_a_rows_kernel_bytes_sit_beside_the_applications_with_the_overhead_per_request() -> None:
    learners = [_report("a", 1000, 500, 10, []), _report("b", 2000, 700, 20, [])]
    kernel = [{"sent": 3000, "received": 1500, "packets_sent": 9, "packets_received": 8},
              {"sent": 4000, "received": 2700, "packets_sent": 9, "packets_received": 8}]
    fields = kernel_fields(WanResult([(0.0, 3.0)], 3.0, 1, 10.0, learners, {}, kernel))
    assert fields["kernel_bytes_sent"] == [3000, 4000] and fields["app_bytes_received"] == [500, 700]
    assert fields["overhead_per_request_bytes"] == {"sent": pytest.approx(150.0),
                                                    "received": pytest.approx(100.0)}
    assert kernel_fields(WanResult([(0.0, 3.0)], 3.0, 1, 10.0, learners))["kernel_bytes_sent"] is None


def test_a_cut_counts_the_steps_each_learner_computed_while_it_was_down() -> None:
    learners = [_report("a", 1, 1, 1, [1.0, 2.5, 3.5, 6.0]), _report("b", 1, 1, 1, [1.0, 6.0])]
    result = WanResult([(0.0, 3.0)], 3.0, 1, 10.0, learners, {"cut_window_s": [2.0, 4.0]})
    cut = cut_fields(result, h=40, down_s=2.0)
    assert cut["steps_during_cut"] == [80, 0] and cut["phases_after_cut"] == [1, 1] and cut["learner"] == "a"
    dp = {"cut": {"down_s": 2.0, "link_mb_s": 1.0, "window": (100.0, 102.0),
                  "steps": [[[104.0, 4.0], [105.0, 1.0], [106.0, 1.0]],
                            [[104.0, 3.9], [105.0, 1.1], [106.0, 1.0]]]}}
    stalled = dp_cut_fields(dp, clean_step_s=1.0)
    assert stalled["step_s"] == [4.0, 1.1, 1.0] and stalled["stall_s"] == pytest.approx(3.1)
    assert stalled["steps_done_while_down"] == 0 and dp_cut_fields({}, 1.0) is None

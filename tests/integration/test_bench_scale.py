"""`diloco bench scale --quick`: the JSON has the issue's keys (and the merge time's reference, the log's
bucket growth, a merger's cold restart and a learner's rejoin), every row merged 3K rounds with the
production merger in fresh processes, and the staggered schedule's peak upload shrinks with P.

Run: .venv/bin/pytest tests/integration/test_bench_scale.py -q
"""

from __future__ import annotations

import json
import statistics

import pytest

from diloco.bench._scale_rounds import PASSES
from diloco.bench.scale import bench_scale, peak_window_bytes


def test_quick_scale_bench_writes_the_issue_keys(tmp_path):
    out = tmp_path / "scale.json"
    bench_scale.benchmark.run(out, learners=2, fragments="1,4", quick=True, checkpoint_every=3)
    result = json.loads(out.read_text())
    assert set(result) == {"model_params", "learners", "rows", "codec"}
    assert result["learners"] == 2 and result["model_params"] > 0
    assert set(result["codec"]) == {"int4"} and set(result["codec"]["int4"]) == {"encode_mb_s", "decode_mb_s"}
    keys = {"fragments", "largest_fragment_mb", "merge_peak_rss_mb", "merge_s_per_round", "publish_mb",
            "peak_upload_ratio_vs_unfragmented"}
    floor = {"read_decode_s", "state_io_s", "merge_vs_read_decode"}  # the merge-time target's reference
    log = {"bucket_bytes_per_version", "bucket_bytes_per_param_per_version", "recovery_s",
           "recovery_replayed", "rejoin_s", "rejoin_bytes", "rejoin_full_params_s", "merger_rss_mb",
           "state_held_mb", "checkpoint_every", "rounds", "first_merge_peak_rss_mb",
           "merge_kept_mb", "merge_page_faults"}  # issue #41
    runs = {"read_decode_runs_s", "rejoin_runs_s", "rejoin_full_params_runs_s"}  # the medians' passes
    assert [set(r) for r in result["rows"]] == [keys | floor | log | runs] * 2
    for row in result["rows"]:
        assert row["read_decode_s"] > 0 and row["state_io_s"] > 0
        assert row["rounds"] == 3 * row["checkpoint_every"]
        # the blocks a merger keeps between merges (8 + 4 B a parameter of the largest chain), in its memory
        assert row["merge_kept_mb"] == pytest.approx(3 * row["largest_fragment_mb"], rel=1e-9)
        assert row["merge_peak_rss_mb"] >= row["merge_kept_mb"]
        assert row["merge_vs_read_decode"] == row["merge_s_per_round"] / row["read_decode_s"]
        k, p = row["checkpoint_every"], row["fragments"]  # fragment f's checkpoint grid is shifted by f*K//P
        assert row["recovery_replayed"] == sum((3 * k - 1 + f * k // p) % k for f in range(p))  # K-1 at P = 1
        assert row["rejoin_s"] > 0 and row["rejoin_bytes"] > 0 and row["recovery_s"] > 0
        for median, passes in (("read_decode_s", "read_decode_runs_s"), ("rejoin_s", "rejoin_runs_s"),
                               ("rejoin_full_params_s", "rejoin_full_params_runs_s")):
            assert len(row[passes]) == PASSES and row[median] == statistics.median(row[passes])
        # per version: the update (~0.5 B/param at int4), the manifest, 12 B/param of state every K versions
        assert 0.4 < row["bucket_bytes_per_param_per_version"] < 0.6 + 12 / row["checkpoint_every"] + 0.5
    whole, four = result["rows"]
    assert whole["peak_upload_ratio_vs_unfragmented"] == 1.0
    assert four["peak_upload_ratio_vs_unfragmented"] <= 1.4 / 4  # the issue's target, on bytes
    assert four["largest_fragment_mb"] < whole["largest_fragment_mb"]
    assert four["publish_mb"] < whole["publish_mb"]


def test_peak_window_of_the_staggered_schedule():
    assert peak_window_bytes([100], 24) == 100  # P = 1: one whole publish per window of H steps
    assert peak_window_bytes([10, 20, 30, 40], 24) == 40  # P = 4, window of 6 steps: one fragment at most
    assert peak_window_bytes([5, 5, 5], 2) == 10  # P > H: fragments share steps, window of one step

"""Benchmarks: the bandwidth model in closed form, the arrival schedules, byte counting, and smoke
runs of `bench quality --quick` and `bench merge` at tiny sizes. Never asserts wall time or targets.

Run: .venv/bin/pytest tests/unit/test_bench.py  (the quality smoke is marked slow).
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from diloco.bench._quality_runs import active_learners, quorum_of
from diloco.bench.bandwidth import (
    allreduce_bytes_per_step,
    bandwidth_model,
    codec_bytes_per_param,
    required_gbps,
)
from diloco.cli import app
from diloco.storage import open_store
from diloco.storage.traffic import CountingStore, object_kind

runner = CliRunner()


# ---- bandwidth model ------------------------------------------------------------------------
def test_allreduce_bytes_closed_form() -> None:
    assert allreduce_bytes_per_step(1000, 4) == 2 * 3 / 4 * 4 * 1000
    assert allreduce_bytes_per_step(1000, 1) == 0.0
    assert allreduce_bytes_per_step(10, 2, bytes_per_param=2) == 20.0
    with pytest.raises(ValueError):
        allreduce_bytes_per_step(0, 4)


def test_required_gbps_overlapped_and_exposed() -> None:
    # 1e9 bytes in 1 s of compute at 95% busy: overlapped allows 1/0.95 s, exposed 0.05/0.95 s
    assert required_gbps(1e9, 1.0, 0.95, overlapped=True) == pytest.approx(8 * 0.95)
    assert required_gbps(1e9, 1.0, 0.95, overlapped=False) == pytest.approx(8 * 0.95 / 0.05)
    with pytest.raises(ValueError):
        required_gbps(1e9, 1.0, 1.0, overlapped=True)


def test_codec_sizes_ordered() -> None:
    sizes = [codec_bytes_per_param(c) for c in ("fp32", "bf16", "int8", "int4")]
    assert sizes == sorted(sizes, reverse=True)
    assert 3.0 < sizes[0] <= 4.01  # fp32 + byte-shuffle + lz4 squeezes the exponent bytes a little
    assert 0.38 < sizes[3] < 0.5  # 4 bits + block scales (0.516 raw), less zstd's entropy stage (~3.3 bits)
    with pytest.raises(ValueError):
        codec_bytes_per_param("int5")


def test_bandwidth_model_closed_form() -> None:
    n, s, m, h = 1_000_000, 0.5, 4, 100
    row = bandwidth_model(n, s, m, h, codec="int4", update_codec="int8")
    dp_bytes = 2 * (m - 1) / m * 4 * n
    assert row["dp_gbps_exposed"] == pytest.approx(dp_bytes * 8 / (s * 0.05 / 0.95) / 1e9)
    assert row["dp_gbps_overlapped"] == pytest.approx(dp_bytes * 8 / (s / 0.95) / 1e9)
    busiest = max(codec_bytes_per_param("int4"), codec_bytes_per_param("int8")) * n  # int8 down is bigger
    assert row["diloco_gbps_overlapped"] == pytest.approx(busiest * 8 / (h * s / 0.95) / 1e9)
    assert row["reduction_overlapped"] == pytest.approx(dp_bytes * h / busiest)


def test_bandwidth_scales_linearly_with_h() -> None:
    a = bandwidth_model(10**6, 1.0, 8, 50, "int4")
    b = bandwidth_model(10**6, 1.0, 8, 500, "int4")
    assert b["reduction_overlapped"] == pytest.approx(10 * a["reduction_overlapped"])
    assert b["dp_gbps_exposed"] == a["dp_gbps_exposed"]


def test_bandwidth_cli_json(tmp_path) -> None:
    out = tmp_path / "bw.json"
    result = runner.invoke(app, ["bandwidth", "--params", "12e9", "--step-time-s", "1", "--learners", "4",
                                 "--inner-steps", "500", "--codec", "int4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    row = json.loads(out.read_text())
    assert row["num_params"] == 12_000_000_000 and row["reduction_overlapped"] > 1
    bad = runner.invoke(app, ["bandwidth", "--params", "1e6", "--step-time-s", "1", "--learners", "4",
                              "--inner-steps", "5", "--codec", "int5"])
    assert bad.exit_code == 2


# ---- schedules and byte counting --------------------------------------------------------------
def test_schedules() -> None:
    assert active_learners("all", 4, 7) == [0, 1, 2, 3]
    assert active_learners("alternate", 4, 0) == [0, 2]
    assert active_learners("alternate", 4, 1) == [1, 3]
    assert active_learners("hetero", 4, 0) == [0, 1]
    assert active_learners("hetero", 4, 1) == [0, 1, 2, 3]
    assert (quorum_of("all", 4), quorum_of("alternate", 4), quorum_of("hetero", 4)) == (4, 2, 2)
    # every learner of "alternate" does the same number of phases over two rounds
    counts = [sum(i in active_learners("alternate", 4, r) for r in range(8)) for i in range(4)]
    assert counts == [4, 4, 4, 4]
    with pytest.raises(ValueError):
        active_learners("random", 4, 0)


def test_counting_store_counts_by_kind(tmp_path) -> None:
    store = CountingStore(open_store(f"file://{tmp_path}"))
    store.put_if_absent("run/deltas/a-0/000000000000.delta", b"x" * 10)
    store.put("run/learners/a-0/status.json", b"y" * 3)
    store.put("run/global/1-abc.update", b"z" * 7)
    assert store.get("run/global/1-abc.update") == b"z" * 7
    assert store.sent["delta"] == 10 and store.sent["status"] == 3 and store.sent["global"] == 7
    assert store.received["global"] == 7
    assert store.exists("run/global/1-abc.update")  # delegated, and a HEAD counts nothing
    assert store.list("run/global/") == ["run/global/1-abc.update"]
    assert store.received["listing"] == len("run/global/1-abc.update") + 1  # a listing: its keys' bytes
    store.reset()
    assert sum(store.sent.values()) == 0
    assert object_kind("run/versions/00000000000000000001.json") == "manifest"
    assert object_kind("run/learners/a-0/checkpoint/pointer.json") == "checkpoint"
    assert object_kind("run/learners/a-0/checkpoint/m000000000003-0a1b2c3d.p0000") == "checkpoint"
    assert object_kind("run/events/a-0/1-2-3.jsonl") == "event" and object_kind("run/run.json") == "other"



def test_counting_store_views_count_too(tmp_path) -> None:
    store = CountingStore(open_store(f"file://{tmp_path}"))
    quick = store.with_retries(1)  # what a learner's heartbeats and probes go through
    assert isinstance(quick, CountingStore) and quick.max_retries == 1 and store.max_retries == 5
    quick.put("run/learners/a-0/status.json", b"y" * 3)
    assert quick.get("run/learners/a-0/status.json") == b"y" * 3
    assert store.sent["status"] == 3 and store.received["status"] == 3
    store.reset()
    assert sum(quick.sent.values()) == 0


def test_rows_computing_at_once_report_the_both_ways_target() -> None:
    """Each concurrent row's ratios to DP and whether it is >= 400x less both ways at <= 1.01x DP's loss."""
    from diloco.bench.quality import _ratios

    def row(loss: float, sent: float, received: float) -> dict:
        return {"eval_loss": loss, "bytes_sent_per_learner": sent, "bytes_received_per_learner": received}

    dp = row(1.6, 1000.0, 1000.0)
    out = _ratios({"dp": dp, "streaming-clock-int4": row(1.6, 2.0, 4.0),  # 500x / 250x: received too high
                   "streaming-clock-full-int4": row(1.6159, 2.0, 2.0),  # 500x both ways under 1.01x: met
                   "streaming-clock-hetero-dylu": row(1.6161, 1.0, 1.0)})  # above 1.01x
    assert out["concurrent"]["received_ratio_vs_dp"] == pytest.approx(250.0)
    assert out["concurrent"]["both_ways_met"] is False
    assert out["concurrent_in_step"]["method"] == "streaming-clock-full-int4"
    assert out["concurrent_in_step"]["loss_ratio_vs_dp"] == pytest.approx(1.6159 / 1.6)
    assert out["concurrent_in_step"]["both_ways_met"] is True
    assert out["concurrent_hetero"]["both_ways_met"] is False
    assert "concurrent_in_step" not in _ratios({"dp": dp})  # only the rows that ran


# ---- smoke runs ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_quality_quick_smoke(tmp_path) -> None:
    out, png = tmp_path / "q.json", tmp_path / "q.png"
    result = runner.invoke(app, ["bench", "quality", "--quick", "--json", str(out), "--png", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data) >= {"methods", "loss_ratio_vs_dp", "traffic_ratio_vs_dp", "config"}
    assert set(data["methods"]) == {"dp", "sync-fp32", "decoupled-int8", "decoupled-int4", "hetero-int4",
                                    "streaming-clock-int4", "streaming-clock-hetero-dylu"}
    tokens = {m["tokens"] for m in data["methods"].values()}
    assert len(tokens) == 1  # equal tokens for every method
    for name, m in data["methods"].items():
        for key in ("eval_loss", "eval_loss_bits", "bytes_sent_per_learner", "bytes_received_per_learner",
                    "seeds"):
            assert key in m, (name, key)
        assert m["eval_loss_bits"] == pytest.approx(m["eval_loss"] / math.log(2))
        curve = m["seeds"][0]["curve"]
        assert curve[0][0] == 0 and curve[-1][0] == m["tokens"]
        assert m["bytes_sent_per_learner"] > 0
        assert min(loss for _, loss in curve[1:]) < curve[0][1], name  # training did lower the loss
    for name in ("dp", "sync-fp32"):
        first, last = data["methods"][name]["seeds"][0]["curve"][0][1], data["methods"][name]["eval_loss"]
        assert last < first, name  # training lowers the held-out loss
    assert data["traffic_ratio_vs_dp"] > 1
    concurrent, clock = data["concurrent"], data["methods"]["streaming-clock-int4"]
    assert concurrent["method"] == "streaming-clock-int4"
    assert concurrent["loss_ratio_vs_dp"] == pytest.approx(clock["eval_loss"]
                                                           / data["methods"]["dp"]["eval_loss"])
    assert concurrent["received_ratio_vs_dp"] > 1
    hetero, dylu = data["concurrent_hetero"], data["methods"]["streaming-clock-hetero-dylu"]
    assert hetero["method"] == "streaming-clock-hetero-dylu"
    assert hetero["traffic_ratio_vs_dp"] == pytest.approx(data["methods"]["dp"]["bytes_sent_per_learner"]
                                                          / dylu["bytes_sent_per_learner"])
    assert png.stat().st_size > 0


def test_merge_bench_smoke(tmp_path) -> None:
    out = tmp_path / "m.json"
    result = runner.invoke(app, ["bench", "merge", "--sizes", "tiny", "--learners", "1,3", "--json",
                                 str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["num_learners"] for r in rows] == [1, 3]
    assert [r["merged"] for r in rows] == [1, 3]
    assert all(r["merge_s"] > 0 and r["peak_rss_delta_bytes"] >= 0 for r in rows)
    bad = runner.invoke(app, ["bench", "merge", "--sizes", "huge"])
    assert bad.exit_code == 2

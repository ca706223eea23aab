"""`diloco bench size` end to end on a small model: one `diloco run` with its real processes, a learner killed
and restarted by a chaos plan; every figure of the row is there, the killed learner rejoined (from its local
state) and was merged again, the loss fell, the audit passed, and the learners' uploads stayed within 1.2x
their deltas. Run: .venv/bin/pytest tests/integration/test_bench_size.py -q
"""

from __future__ import annotations

import json

from diloco.bench.size import bench_size

KEYS = ("model_params", "wall_s", "initial_eval_loss", "final_eval_loss", "learner_peak_rss_bytes_per_param",
        "merger_peak_rss_bytes_per_param", "learner_upload_bytes_per_phase", "delta_bytes_per_phase",
        "bucket_bytes_per_param_per_version", "merge_s_per_round", "rejoin_s")


def test_a_small_model_end_to_end_with_a_learner_killed_and_rejoining(tmp_path):
    out = tmp_path / "size.json"
    result = bench_size.benchmark.run(out, params="quick", fragments="1", steps=96, kill_at=1).data
    row = json.loads(out.read_text())["rows"][0]
    assert all(row.get(key) is not None for key in KEYS), {k: row.get(k) for k in KEYS}
    assert row["model_params"] == result["rows"][0]["model_params"] > 0
    assert row["rejoined_contributed"] and row["rejoined_from_local_state"] and row["learner_processes"] == 3
    assert row["audit_ok"] and row["loss_drop"] >= 0.5
    assert row["upload_over_delta"] <= 1.2  # statuses, events, checkpoint pointers: a few % of the deltas
    assert row["learner_sent_by_kind"]["delta"] == round(row["delta_bytes_per_phase"] * row["phases"])
    assert set(result["targets"]) >= {"audit OK", "killed learner rejoins and contributes again"}

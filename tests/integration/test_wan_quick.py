"""`diloco bench wan --quick`: real learner processes behind capped links, the JSON keys the issue names,
three caps, bytes counted both ways; and the peer rows skip with the reason when torchft is missing.
Run: `.venv/bin/pytest tests/integration/test_wan_quick.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.bench import peer_torchft, quality
from diloco.bench._quality_runs import METHODS
from diloco.configs import ConfigError


@pytest.mark.slow  # ~40 s of CPU: 6 real runs of 4 learner processes, a DP run and the evaluations
def test_quick_wan_writes_the_issue_keys(tmp_path: Path) -> None:
    out = tmp_path / "wan.json"
    proc = subprocess.run([sys.executable, "-m", "diloco.cli", "bench", "wan", "--quick", "--no-peer",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    for key in ("link_mb_s", "target_loss", "time_to_target_s", "speedup_vs_dp", "traffic_ratio_vs_dp",
                "final_loss"):
        assert key in r, key
    assert set(r["time_to_target_s"]) == set(r["final_loss"]) == {"dp", "sync_diloco", "decoupled"}
    assert r["traffic_ratio_vs_dp"]["sent"] > 1 and r["traffic_ratio_vs_dp"]["received"] > 1
    caps = [row["link_mb_s"] for row in r["rows"]]
    assert caps == pytest.approx([caps[0], 2 * caps[0], caps[0] / 2])
    dec = r["methods"]["decoupled"]
    # the default row
    assert r["config"]["decoupled_fragments"] == 8 and r["config"]["decoupled_cohorts"] is True
    assert dec["versions"] >= 2 and 0 < dec["busy_mean"] <= 1.0 + 1e-9
    assert dec["delta_bytes_sent_per_learner"] > 0 and dec["global_bytes_received_per_learner"] > 0
    assert r["methods"]["dp"]["modelled"] and r["config"]["torchft_skipped"] == "--no-peer"
    sync = r["methods"]["sync_diloco"]
    assert sync["versions"] == r["config"]["steps_per_learner"] // r["config"]["inner_steps_per_phase"]


def test_peer_rows_skip_with_the_reason_when_torchft_is_missing(monkeypatch) -> None:
    monkeypatch.setattr(peer_torchft.importlib.util, "find_spec", lambda name: None)
    peer = tuple(m for m in METHODS if m.kind == "peer")
    kept, skipped = quality._drop_unavailable((METHODS[0], *peer))
    assert kept == (METHODS[0],) and set(skipped) == {m.name for m in peer}
    assert "pip install 'diloco[peer]'" in next(iter(skipped.values()))
    with pytest.raises(ConfigError, match="torchft is not installed"):
        quality._drop_unavailable(peer)
    with pytest.raises(peer_torchft.PeerUnavailable):
        peer_torchft.run_torchft(quality.load_config("bench"), 40, 1234)

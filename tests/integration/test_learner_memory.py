"""A learner's memory per phase stays at the AdamW floor: over phases with ships, prefetched installs,
local-state saves and bucket checkpoints, its resident high-water mark above the floor after its first step
(the model and the optimizer's moments) is the gradients of one step and small temporaries — never another
whole-model copy (G, r, a clone of the optimizer state, an encoded state), which would add one model's bytes
and fail here. The learner runs in a fresh process (its own VmHWM), the merger in another; a model of 12.6M
parameters (50 MB fp32) with a short context, so activations are small beside it. Linux only (/proc).
Run: .venv/bin/pytest tests/integration/test_learner_memory.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.configs import load_config
from diloco.run.create import create_run
from diloco.storage import open_store

CHILD = Path(__file__).with_name("memory_child.py")
# grads (1.0 of the model) + activations and per-tensor temporaries; one more whole-model copy would be >= 2.0
BOUND = 1.6


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_a_learners_phases_stay_within_one_model_of_its_floor(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    cfg = load_config("bench").with_overrides({
        "model.n_layer": 4, "model.n_head": 8, "model.d_model": 512, "model.ctx_len": 16,
        "data.batch_size": 1,
        "run.num_learners": 2, "merger.quorum": 1, "merger.grace_cap_s": 0.0, "inner.steps_per_phase": 4,
        "learner.prefetch": True, "learner.prefetch_poll_s": 0.02, "learner.local_state_every_steps": 2,
        "learner.checkpoint_every": 1, "eval.num_batches": 1, "eval.batch_size": 1})
    create_run(open_store(url), "mem", cfg)
    env = {**os.environ, "DILOCO_LOCAL_DIR": str(tmp_path / "local"), "OMP_NUM_THREADS": "1"}
    merger = subprocess.Popen([sys.executable, "-m", "diloco.launch", "merger", "--storage", url,
                               "--run-id", "mem"], env=env)
    try:
        child = subprocess.run([sys.executable, str(CHILD), url, "mem", "3"], capture_output=True, text=True,
                               env=env, timeout=300)
    finally:
        merger.terminate()
        merger.wait(30)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["base"] >= 2  # it installed versions (prefetched) between its phases
    above = (got["peak"] - got["floor"]) / got["param_bytes"]
    assert above <= BOUND, f"{above:.2f} models above the floor (bound {BOUND}): {got}"

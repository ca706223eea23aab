"""Multi-rank learners (torch.distributed inside a learner, gloo on CPU, started by torch's launcher): the
oracle — a 2-rank learner equals a 1-rank learner with the same global batch and seed, step for step within
fp32 tolerance; a 1-rank and a 2-rank learner in one run merge by their tokens; bad rank counts are refused
naming the field.

Run: .venv/bin/pytest tests/integration/test_ranks.py   (about 40 s on 2 cores: real processes)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.configs import ConfigError, load_config
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.context import open_run
from diloco.run.create import create_run
from diloco.run.objects import read_tensors
from diloco.storage import open_store
from diloco.storage.records import LearnerStatus, read_record

pytestmark = pytest.mark.slow
BASE = {"learner.codec": "fp32", "run.num_learners": 2, "learner.local_state_every_steps": 0}


def learner(url: str, run_id: str, name: str, phases: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "diloco.launch", "learner", "--storage", url, "--run-id",
                             run_id,
                             "--name", name, "--phases",
                             str(phases)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]


def test_two_ranks_equal_one_rank_step_for_step(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    for ranks in (1, 2):
        create_run(open_store(url), f"r{ranks}",
                   load_config("tiny").with_overrides({**BASE, "learner.ranks": ranks}))
        finish(learner(url, f"r{ranks}", "local-0", 3))
    one, two = open_run(url, "r1"), open_run(url, "r2")
    for seq in range(3):  # three phases of 10 steps, no merge in between: 30 steps compared
        h1, d1 = read_tensors(one.store, one.keys.delta("local-0", seq))
        h2, d2 = read_tensors(two.store, two.keys.delta("local-0", seq))
        assert h1.meta["tokens"] == h2.meta["tokens"] == 10 * 8 * 32  # the learner's batch, not a rank's
        assert h2.meta["train_loss"] == pytest.approx(h1.meta["train_loss"], rel=1e-5)
        for k in d1:
            scale = float(d1[k].abs().max()) or 1.0
            assert float((d1[k] - d2[k]).abs().max()) <= 1e-5 * scale + 1e-7, k
    status = read_record(two.store, two.keys.status("local-0"), LearnerStatus)
    assert status.ranks == 2 and len(set(status.rank_pids)) == 2


def test_two_ranks_follow_rank_0s_run_clock(tmp_path: Path) -> None:
    """inner.schedule_clock "run": a learner joining version 1 moves its schedule to the run's clock at its
    first step; rank 0 sends it to rank 1, so the 2-rank learner still equals the 1-rank one (and differs from
    the own clock's)."""
    url = f"file://{tmp_path}/store"
    deltas = {}
    for ranks, clock in ((1, "run"), (2, "run"), (1, "own")):
        run_id = f"c{ranks}{clock}"
        ctx = create_run(open_store(url), run_id, load_config("tiny").with_overrides(
            {**BASE, "learner.ranks_per_learner": {"local-1": ranks}, "inner.schedule_clock": clock,
             "merger.quorum": 1, "merger.grace_cap_s": 0.0, "learner.checkpoint": False}))
        first = Learner(ctx, "local-0")
        first.join()
        first.publish(first.run_phase())
        first.close()
        merger = Merger(ctx)
        merger.load()
        assert merger.merge_once().version == 1
        finish(learner(url, run_id, "local-1", 2))
        run = open_run(url, run_id)
        deltas[ranks, clock] = [read_tensors(run.store,
                                             run.keys.delta("local-1", seq))[1] for seq in range(2)]
    moved = 0.0
    for seq in range(2):
        one, two, own = (deltas[key][seq] for key in ((1, "run"), (2, "run"), (1, "own")))
        for k in one:
            scale = float(one[k].abs().max()) or 1.0
            # fp32 drift over 20 steps: 2.3e-5 of the scale at most (measured); rank 1 on its own clock:
            # 0.4-0.7
            assert float((one[k] - two[k]).abs().max()) <= 1e-4 * scale, (seq, k)
            moved = max(moved, float((one[k] - own[k]).abs().max()) / scale)
    assert moved > 1e-2  # the run's clock is 5 steps ahead in the warmup: another lr, other deltas


def test_a_one_rank_and_a_two_rank_learner_merge_by_their_tokens(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    cfg = load_config("tiny").with_overrides({**BASE, "learner.ranks_per_learner": {"local-1": 2}})
    ctx = create_run(open_store(url), "mixed", cfg)
    procs = [learner(url, "mixed", name, 1) for name in ctx.learners]
    for proc in procs:
        finish(proc)
    merger = Merger(ctx)
    merger.load()
    manifest = merger.merge_once()
    merged = {d.learner: d for d in manifest.merged()}
    assert set(merged) == {"local-0", "local-1"} and merged["local-0"].tokens == merged["local-1"].tokens
    assert merged["local-0"].weight == pytest.approx(merged["local-1"].weight)  # same tokens, same steps
    ranks = {n: read_record(ctx.store, ctx.keys.status(n), LearnerStatus).ranks for n in ctx.learners}
    assert ranks == {"local-0": 1, "local-1": 2}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"learner.ranks": 0}, "learner.ranks: Input should be greater than or equal to 1"),
    ({"learner.ranks": 65}, "learner.ranks: Input should be less than or equal to 64"),
    ({"learner.ranks_per_learner": {"local-1": 0}},
     r"learner.ranks_per_learner.local-1: 0 must be an int in \[1, 64\]"),
    ({"learner.ranks_per_learner": {"Bad_Name": 2}}, "is not a learner name"),
])
def test_bad_rank_counts_are_refused_naming_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("tiny").with_overrides(overrides)


def test_bench_ranks_smoke(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from diloco.cli import app

    out = tmp_path / "ranks.json"
    result = CliRunner().invoke(app, ["bench", "ranks", "--config", "tiny", "--phases", "2", "--json",
                                      str(out)])
    assert result.exit_code == 0, result.output
    import json

    data = json.loads(out.read_text())
    assert [r["ranks"] for r in data["rows"]] == [1, 2] and all(r["tokens_per_s"] > 0 for r in data["rows"])
    assert data["speedup_2_vs_1"] == pytest.approx(data["rows"][1]["tokens_per_s"]
                                                   / data["rows"][0]["tokens_per_s"])


def test_a_batch_the_ranks_cannot_split_is_refused_at_creation(tmp_path: Path) -> None:
    from diloco.training.spec import SpecError

    cfg = load_config("tiny").with_overrides({"learner.ranks": 3})  # the tiny batch is 8
    with pytest.raises(SpecError, match="learner.ranks = 3 does not divide the batch's first dimension 8"):
        create_run(open_store(f"file://{tmp_path}/store"), "three", cfg)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*"))

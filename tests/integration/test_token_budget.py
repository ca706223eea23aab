"""A token budget ends a run: `run.num_tokens` > 0 finishes it at the first version whose merged tokens reach
the budget (on every chain of a fragmented run), whatever `run.num_versions` says; roles started after it end
at once, `status` says so in tokens, and `diloco resume` grows the budget by run.json's again.

Run: .venv/bin/pytest tests/integration/test_token_budget.py -q
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

from diloco.api.operate import prepare_resume
from diloco.configs import load_config
from diloco.inspect.runs import list_runs
from diloco.launch import run_role
from diloco.merger.step import TOKENS_SLACK
from diloco.run.context import open_run
from diloco.run.create import create_run
from diloco.run.state import read_run_state
from diloco.run.target import Target, run_tokens, target_reached
from diloco.storage import Manifest, open_store, read_latest, read_manifest


def _manifest(version: int, tokens: int) -> Manifest:
    return Manifest(run_id="r", version=version, parent=max(0, version - 1), created_at=0.0,
                    merger_id="merger", params_key="p", params_checksum="c", tokens_total=tokens)


def test_a_chain_reaches_the_target_by_versions_or_by_tokens() -> None:
    assert not Target(5).reached_by(None) and not Target(5).reached_by(_manifest(4, 10**9))
    assert Target(5).reached_by(_manifest(5, 0))
    budget = Target(50, tokens=1000)
    assert not budget.reached_by(_manifest(3, 999)) and budget.reached_by(_manifest(3, 1000))
    assert budget.reached_by(_manifest(50, 0))  # num_versions still bounds a run with a budget
    assert budget.describe() == "1,000 tokens (at most 50 versions)" and Target(5).describe() == "5 versions"


def test_the_merger_stops_at_the_first_version_that_reaches_the_budget(tmp_path) -> None:
    url = f"file://{tmp_path}/runs"
    tiny = load_config("tiny")
    per_delta = tiny.inner.steps_per_phase * tiny.data.batch_size * tiny.model.ctx_len  # one phase's tokens
    budget = 2 * per_delta + per_delta // 2  # reached by the third delta, not the second
    cfg = tiny.with_overrides({"run.num_learners": 1, "run.num_versions": 50, "run.num_tokens": budget,
                               "learner.local_state_every_steps": 0})
    ctx = create_run(open_store(url), "tok", cfg)
    run_role("learner", url, "tok", "local-0", phases=1)
    assert run_role("merger", url, "tok", merges=1) == 1
    assert run_tokens(ctx) == per_delta and not target_reached(ctx)
    assert read_run_state(ctx).where() == f"version 1, {per_delta:,} of {budget:,} tokens"
    run_role("learner", url, "tok", "local-0", phases=3)
    assert run_role("merger", url, "tok", merges=5) == 1  # the three pending deltas in one merge, then done
    # a learner's deltas piled up in one merge count as its weight counts them: up to max_phases_per_merge
    # phases of steps, TOKENS_SLACK x the run's tokens per step each (2.5 phases' tokens of the 3 claimed)
    piled = min(3 * per_delta, math.floor(tiny.merger.max_phases_per_merge * TOKENS_SLACK * per_delta))
    assert piled < 3 * per_delta
    assert target_reached(ctx) and run_tokens(ctx) == per_delta + piled
    state = read_run_state(ctx)
    assert (state.word == "finished"
            and state.title() == f"finished: version 2, {per_delta + piled:,} of {budget:,} tokens")
    assert run_role("merger", url, "tok", merges=5) == 0  # nothing more to merge: the run is done
    [listed] = list_runs(open_store(url))
    assert (listed["state"], listed["tokens"], listed["token_budget"]) == \
        ("finished", per_delta + piled, budget)

    report = prepare_resume(url, "tok", versions=10)
    resumed = open_run(url, "tok")
    assert resumed.cfg.run.num_tokens == per_delta + piled + budget and resumed.cfg.run.num_versions == 12
    assert report["state"] == "finished" and read_run_state(resumed).word == "idle"


def _diloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli", *args], capture_output=True, text=True,
                          timeout=240)


def test_a_fragmented_run_ends_on_its_token_budget(tmp_path) -> None:
    storage = f"file://{tmp_path}/runs"
    tiny = load_config("tiny")
    # about 5 phases' tokens
    budget = 5 * tiny.inner.steps_per_phase * tiny.data.batch_size * tiny.model.ctx_len
    done = _diloco("run", "--config", "tiny", "--storage", storage, "--run-id", "tokf", "--no-prefect",
                   "--no-live",
                   "--json", "--learners", "2", "--versions", "200", "-o", f"run.num_tokens={budget}",
                   "-o", "fragments.count=2", "-o", "merger.shards=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"target {budget:,} tokens (at most 200 versions)" in " ".join(done.stderr.split())  # rich wraps
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    ctx = open_run(storage, "tokf")
    assert summary["extra"]["state"] == "finished" and run_tokens(ctx) >= budget
    for p in range(2):  # every chain stopped at the first version that reached the budget
        keys = ctx.keys.for_fragment(p)
        head = read_latest(ctx.store, keys)
        assert head.version < 200 and head.tokens_total >= budget
        assert read_manifest(ctx.store, keys, head.version - 1).tokens_total < budget
    audit = _diloco("audit", "--storage", storage, "--run-id", "tokf", "--json")
    assert audit.returncode == 0, audit.stderr[-2000:]

"""The summary of any run is complete: version 0's and the final version's held-out loss (evaluated at the
end when the evaluator never got to them), deltas merged / rejected / pending, every learner's bytes sent and
received against data-parallel, the run's state — and `diloco summary` / `diloco runs` print it.

Run: .venv/bin/pytest tests/integration/test_summary.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from diloco.cli.view import unmerged_lines
from diloco.configs import load_config
from diloco.evaluator.evaluator import evaluate_missing as complete_evals
from diloco.evaluator.evaluator import missing_evals
from diloco.inspect.runs import list_runs
from diloco.inspect.summary import build_summary, learner_busy, summary_markdown, summary_rows
from diloco.launch import run_role
from diloco.run.create import create_run
from diloco.run.signals import request_stop
from diloco.storage import open_store
from diloco.storage.records import LearnerStatus, write_record


def _diloco(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "diloco.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


def test_a_run_the_evaluator_never_saw_gets_a_complete_summary(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/runs"
    cfg = load_config("tiny").with_overrides({"run.num_learners": 2, "run.num_versions": 50,
                                              "learner.local_state_every_steps": 0})
    ctx = create_run(open_store(url), "short", cfg)
    run_role("learner", url, "short", "local-0", phases=3)
    assert run_role("merger", url, "short", merges=1) == 1
    run_role("learner", url, "short", "local-0", phases=1)  # published after the last merge: pending
    request_stop(ctx, "operator")

    assert missing_evals(ctx) == [0, 1]
    assert complete_evals(ctx) == [0, 1] and missing_evals(ctx) == []
    s = build_summary(ctx)
    assert (s["initial_eval_loss"] is not None and s["final_eval_version"] == 1
            and s["final_eval_loss"] is not None)
    assert s["deltas_merged"] == 3 and s["deltas_pending"] == 1 and s["bytes_pending"] > 0
    assert s["state"] == "stopped" and s["continue"].startswith("continue with: diloco resume --run-id short")
    rows = {r["learner"]: r for r in s["learners"]}
    mine = rows["local-0"]
    assert mine["deltas_merged"] == 3 and mine["deltas_pending"] == 1
    assert mine["delta_bytes"] == s["bytes_published"]  # the only learner that published
    assert mine["bytes_sent"] >= mine["delta_bytes"] and mine["bytes_received"] > 0  # joins read the params
    assert mine["dp_bytes_each_way"] > 0
    assert rows["local-1"]["bytes_sent"] is None  # never ran: nothing counted, nothing invented
    assert 0.0 < mine["busy"] <= 1.0 and rows["local-1"]["busy"] is None
    text = "\n".join(f"{k} {v}" for k, v in summary_rows(s)) + summary_markdown(s)
    assert "None" not in text and "version 1" in text and "stopped at version 1 of 50 (operator)" in text

    done = _diloco("summary", "--storage", url, "--run-id", "short", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["extra"]["deltas_pending"] == 1
    listed = list_runs(open_store(url))
    assert [(r["run_id"], r["state"], r["version"], r["last_eval_version"]) for r in listed] == [
        ("short", "stopped", 1, 1)]
    assert listed[0]["bucket_bytes"] == sum(open_store(url).sizes("short/").values()) > 0  # what it holds
    table = _diloco("runs", cwd=tmp_path)  # --storage defaults to file://runs in the current folder
    assert table.returncode == 0 and "short" in table.stdout and "stopped" in table.stdout, table.stderr
    assert max(len(line) for line in table.stdout.splitlines()) <= 80


def test_the_run_summary_type_names_every_key_a_summary_has(tmp_path: Path) -> None:
    """diloco.api.RunSummary (what diloco.train returns, `diloco run --json` prints) names the keys of a real
    one."""
    from diloco.api.summary import RunSummary, RunSummaryExtra
    from diloco.inspect.report import summary_json

    ctx = create_run(open_store(f"file://{tmp_path}/runs"), "keys", load_config("tiny").with_overrides(
        {"run.num_learners": 1}))
    summary = summary_json(build_summary(ctx))
    assert set(summary) == set(RunSummary.__annotations__)
    assert set(summary["extra"]) == set(RunSummaryExtra.__annotations__)


def test_busy_is_time_in_inner_steps_over_each_processs_wall_time() -> None:
    def phase(learner, pid, start, duration, compute=None):
        extra = {} if compute is None else {"compute_s": compute}
        return {"kind": "phase", "learner": learner, "pid": pid, "t_start": start, "duration_s": duration,
                **extra}

    events = [phase("a", 1, 100.0, 10.0, 9.0), phase("a", 1, 111.0, 9.0, 8.0),  # process 1: 20 s, 17 in steps
              # a restart: its own 10 s (the gap between is not its wall time)
              phase("a", 2, 500.0, 10.0, 3.0),
              phase("b", 3, 100.0, 10.0),  # a run from before compute_s was recorded: not guessed
              {"kind": "phase", "learner": "a", "pid": 1, "t_start": "soon", "duration_s": 1, "compute_s": 1},
              {"kind": "publish", "learner": "a", "duration_s": 99.0}]
    assert learner_busy(events) == {"a": (17.0 + 3.0) / (20.0 + 10.0)}


def test_status_at_80_columns_keeps_every_name_whole(tmp_path: Path) -> None:
    """us-east-0 and us-east-1 must be told apart, a name too long for 80 columns is shortened from the middle
    (its suffix kept), no column is cut off, and the run's title is wrapped, not cut."""
    url = f"file://{tmp_path}/bucket"
    names = ["us-east-0", "us-east-1", "eu-west-long-region-name-0"]
    cfg = load_config("tiny").with_overrides({"run.storage": url})
    ctx = create_run(open_store(url), "a-fairly-long-run-identifier-2026", cfg, learners=names)
    for name in names:  # every cell filled, with figures as wide as a long run's
        write_record(ctx.store, ctx.keys.status(name), LearnerStatus(
            learner=name, state="stopped", t=time.time() - 125, pid=4242, seq=1234, base_version=2468,
            step=49360,
            cursor=0, loss=1.6543, bytes_published=123_456_789, steps_per_s=41.5,
            unmerged=3 if name == names[1] else 0))
    request_stop(ctx, "operator")
    done = _diloco("status", "--storage", url, "--run-id", ctx.run_id)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    for name in names[:2]:  # whole: they fit
        assert any(name in line and "stopped" in line for line in lines), (name, done.stdout)
    # the long one shortened from the middle, its suffix kept
    long = next(line for line in lines if "…" in line)
    assert "name-0" in long and "stopped" in long and names[2] not in done.stdout, done.stdout
    assert "a-fairly-long-run-identifier-2026" in done.stdout and "stopped at version 0" in done.stdout
    text = "".join(done.stdout.split())  # folded figures read whole once the table's spacing is gone
    assert "beat" in text and text.count("ago") == len(names), done.stdout  # the last column is not cut off
    assert text.count("123.46") >= len(names), done.stdout  # MB out
    # the one with some, in a stopped run
    assert "deltastherunendedwithoutmerging:us-east-13" in text, done.stdout
    rows = [{"learner": "us-east-0", "unmerged": 0}, {"learner": "us-east-1", "unmerged": 3},
            {"learner": "eu-west-0"}]
    assert unmerged_lines(rows,
                          4) == ["deltas not merged yet: us-east-1 3 (learner.max_unmerged 4 per chain: a "
                                 "learner at it trains on and ships the progress later)"]  # a live run
    assert (unmerged_lines(rows[:1], 4) == []
            and unmerged_lines(rows, 0) == ["deltas not merged yet: us-east-1 3"])
    gone = [{**rows[1], "state": "finished"}]  # its loop over in a live run: its count is stale, left out
    assert unmerged_lines(gone, 4) == [] and unmerged_lines(gone, 4, ended=True) != []
    everyday = _diloco("status", "--storage", url, "--run-id", create_run(
        open_store(url), "demo-20261203-083742", cfg, learners=["us-east-0", "us-east-1"]).run_id)
    header = next(line for line in everyday.stdout.splitlines() if "learner" in line)
    # unfolded
    assert all(col in header.split() for col in ("state", "ranks", "steps/s", "beat")), everyday.stdout

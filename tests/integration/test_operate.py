"""Operator controls on a tiny run driven in-process: pause and resume merges while learners publish (nothing
merged while paused, nothing lost after), resume of a finished run (the target raised, the stop cleared,
learners rejoin with their checkpoints' seq and data cursor, audit over the whole history), fork bit-equal to
the parent at V (the parent untouched, a model change refused), and every bad operator input from the CLI one
line, exit 2, nothing written.

Run: .venv/bin/pytest tests/integration/test_operate.py -q   (about 30 s)
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from trust_helpers import install_all, one_round, publish_all, tiny_run
from typer.testing import CliRunner

from diloco.api.operate import fork, pause_merges, prepare_resume, resume_merges
from diloco.cli import app
from diloco.inspect.audit import audit_run
from diloco.learner.learner import Learner
from diloco.merger.loop import ShardMerger, run_merger
from diloco.run.chain_state import params_at
from diloco.run.context import RunError, open_run
from diloco.run.controls import list_ops
from diloco.run.events import EventLog, read_events
from diloco.run.signals import request_stop
from diloco.storage import latest_version, read_manifest
from diloco.storage.records import LearnerStatus, RunRecord, read_record, write_record
from diloco.storage.window import with_window


def _wait(check, timeout_s: float = 20.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if check():
            return True
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_pause_and_resume_merges_while_learners_publish(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path, **{"merger.quorum": 1})
    stop = threading.Event()
    shard = ShardMerger(ctx, events=merger.events)  # the run's one merger loop over its one chain
    thread = threading.Thread(target=run_merger, args=(shard,), kwargs={"should_stop": stop.is_set},
                              daemon=True)
    thread.start()
    try:
        publish_all(learners)
        _wait(lambda: (latest_version(ctx.store, ctx.keys) or 0) >= 1)
        pause_merges(ctx, None, reason="inspect v1", by="ann@ops")
        time.sleep(2.5)  # the merger sees the pause within a second; one merge may have been under way
        paused_at = latest_version(ctx.store, ctx.keys)
        for _ in range(3):
            publish_all(learners)  # learners train and publish on
        time.sleep(1.5)
        assert latest_version(ctx.store, ctx.keys) == paused_at, "a merge was committed while paused"
        resume_merges(ctx, None, by="bob@ops")
        _wait(lambda: latest_version(ctx.store, ctx.keys) > paused_at)
        _wait(lambda: all(read_manifest(ctx.store, ctx.keys, latest_version(ctx.store, ctx.keys)).cursors.get(
            learner.name, -1) >= learner.state.seq - 1 for learner in learners))
    finally:
        stop.set()
        thread.join(timeout=30)
    resumed = read_manifest(ctx.store, ctx.keys, paused_at + 1)
    assert [(e.kind, e.by, e.reason) for e in resumed.controls] == [("pause-merges", "ann@ops", "inspect v1"),
                                                                    ("resume-merges", "bob@ops", "")]
    assert not resumed.guard.paused and len(resumed.merged()) >= 6  # everything published meanwhile
    for learner in learners:
        learner.close()
    report = audit_run(open_run(ctx.store, ctx.run_id))
    assert report.ok and report.deltas_lost == 0 and report.deltas_rejected == 0, report.problems
    kinds = [e["kind"] for e in read_events(ctx.store, ctx.keys) if e["source"] == "operator"]
    assert kinds == ["pause-merges", "resume-merges"]


def test_resume_continues_a_finished_run(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path, **{"run.num_versions": 3})
    for _ in range(3):
        one_round(learners, merger)
    for learner in learners:
        learner.close()
    request_stop(ctx, "target version")  # what the supervisor writes at the end
    seqs = {learner.name: learner.state.seq for learner in learners}
    cursors = {learner.name: learner.cursor for learner in learners}
    plan = prepare_resume(ctx, None, versions=2, by="ann@ops")
    assert (plan["state"], plan["previous_target"], plan["target"]) == ("stopped", 3, 5)
    assert not ctx.store.exists(ctx.keys.stop())
    again = open_run(ctx.store, ctx.run_id)
    assert again.cfg.run.num_versions == 5  # every role started from now on sees the raised target
    fresh = [Learner(again, n, events=EventLog(again.store, again.keys, n)) for n in again.learners]
    for learner in fresh:
        learner.join()  # a new process: the bucket checkpoint gives the optimizer state and the data cursor
        assert learner.state.seq == seqs[learner.name] and learner.cursor == cursors[learner.name]
        assert learner.state.base == 3
    merger.load()
    while merger.version < 5:
        one_round(fresh, merger)
    assert read_manifest(ctx.store, ctx.keys, 4).controls[0].kind == "resume"
    for learner in fresh:
        learner.close()
    report = audit_run(open_run(ctx.store, ctx.run_id))
    assert report.ok and report.num_versions == 6 and report.controls_applied == 1, report.problems
    # a live run (a learner beat just now, no stop, target not reached) is refused
    status = read_record(ctx.store, ctx.keys.status("local-0"),
                         LearnerStatus).model_copy(update={"t": time.time()})
    write_record(ctx.store, ctx.keys.status("local-0"), status)
    prepare_resume(ctx, None, versions=1)  # finished (v5 >= 5): allowed, target 6
    with pytest.raises(RunError, match="is live"):
        prepare_resume(open_run(ctx.store, ctx.run_id), None, versions=1)


def test_fork_is_bit_equal_to_the_parent_at_v_and_leaves_it_untouched(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path)
    for _ in range(3):
        one_round(learners, merger)
    for learner in learners:
        learner.close()
    before = {k: ctx.store.get(k) for k in ctx.store.list(f"{ctx.run_id}/")}
    child = fork(ctx.store, ctx.run_id, 2, "trust-fork", by="ann@ops")
    assert {k: ctx.store.get(k) for k in ctx.store.list(f"{ctx.run_id}/")} == before, "the parent was written"
    parent_v2 = with_window(ctx.store, ctx.keys, read_manifest(ctx.store, ctx.keys, 2))
    child_v0 = with_window(child.store, child.keys, read_manifest(child.store, child.keys, 0))
    theirs, ours = params_at(ctx, 2)[0], params_at(child, 0)[0]  # each from its checkpoint and updates
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    assert child_v0.guard.norms == parent_v2.guard.norms and child_v0.controls[0].kind == "fork"
    assert child_v0.guard.norms and child_v0.guard.window.key.startswith(child.keys.guard_prefix())  # its own
    record = read_record(child.store, child.keys.run_json(), RunRecord)
    assert record.forked_from["run_id"] == ctx.run_id and record.forked_from["version"] == 2
    assert record.forked_from["by"] == "ann@ops"
    kids = [Learner(child, n) for n in child.learners]
    for kid in kids:
        assert kid.join() == 0
    from diloco.merger.merger import Merger

    m = Merger(child)
    assert (m.load() == 0
            and all(bool((m.outer.momentum[k] == merger_outer(ctx, 2)[k]).all()) for k in m.params))
    one_round(kids, m)
    install_all(kids, 1)
    for kid in kids:
        kid.close()
    assert audit_run(open_run(child.store, child.run_id)).ok
    with pytest.raises(RunError, match="keeps the parent's model"):
        fork(ctx.store, ctx.run_id, 2, "trust-fork-2", config="tiny", overrides={"model.d_model": 64,
                                                                              "model.n_head": 4})
    assert not ctx.store.exists("trust-fork-2/run.json") and not ctx.store.list("trust-fork-2/")


def merger_outer(ctx, version: int):
    """The outer state's momentum at `version`, rebuilt from the log (a checkpoint, the merges after it)."""
    from diloco.merger.replay import recover

    return recover(ctx, read_manifest(ctx.store, ctx.keys, version)).outer.momentum


BAD = [
    (["admit-learner", "--learner", "Bad_Name"], "learner name"),
    (["admit-learner", "--learner", "local-0"], "already admitted"),
    (["readmit", "--learner", "local-0"], "not quarantined"),
    (["remove-learner", "--learner", "nobody"], "is not in run"),
    (["resume-merges"], "not paused"),
    (["set", "run.num_learners=3"], "cannot change during a run"),
    (["set", "merger.quorum=0"], "merger.quorum"),
    (["set", "merger.quorum"], "not key=value"),
    (["set", "merger.quorum=true"], "must be an integer"),  # issue #44: no bool is a quorum, no inf a timeout
    (["set", "merger.quorum_timeout_s=.inf"], "must be a finite number"),
    (["admit-learner", "--learner", "evaluator"], "is reserved"),
    (["fork", "--at-version", "99", "--new-run-id", "f"], "has no version 99"),
    (["fork", "--at-version", "1", "--new-run-id", "trust"], "must differ"),
    (["fork", "--at-version", "1", "--new-run-id", "Bad!"], "run id"),
    (["resume", "--versions", "0", "--no-prefect"], "--versions"),
    (["bucket-policy", "--role", "merger"], "s3://"),
    (["bucket-policy", "--role", "root"], "--role"),
    (["audit", "--run-id", "missing"], "no run"),
]


def test_every_bad_operator_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path)
    one_round(learners, merger)
    for learner in learners:
        learner.close()
    url = ctx.store.url
    before = sorted(ctx.store.list(""))
    runner = CliRunner()
    for args, why in BAD:
        run_id = [] if "--run-id" in args else ["--run-id", ctx.run_id]
        result = runner.invoke(app, [args[0], "--storage", url, *run_id, *args[1:]])
        assert result.exit_code == 2, (args, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and why in lines[0], (args, result.output)
    assert sorted(ctx.store.list("")) == before and list_ops(ctx.store, ctx.keys) == []


def test_resume_refuses_a_run_a_live_supervisor_holds_and_writes_nothing(tmp_path: Path) -> None:
    """A stopped run whose supervisor still holds its lease (it is ending its roles) is not changed under
    it."""
    from diloco.configs import load_config
    from diloco.run.create import create_run
    from diloco.run.lease import acquire
    from diloco.storage import open_store

    cfg = load_config("tiny").with_overrides({"run.num_learners": 1})
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "held", cfg)
    lease = acquire(ctx, "local")  # this process: alive, renewed now
    request_stop(ctx, "interrupted")
    with pytest.raises(RunError, match="supervised by"):
        prepare_resume(ctx, None, versions=2)
    assert ctx.store.exists(ctx.keys.stop()) and not list_ops(ctx.store, ctx.keys)
    lease.release("stopped")
    assert prepare_resume(ctx, None, versions=2, wait_s=0.0)["state"] == "stopped"


def test_resume_keeps_the_way_the_run_was_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run started with --no-prefect resumes without Prefect (its last lease's kind says how it was
    supervised); a flag given still wins, and a run supervised with Prefect resumes with it."""
    from diloco import api
    from diloco.cli import view
    from diloco.configs import load_config
    from diloco.run.create import create_run
    from diloco.run.lease import acquire
    from diloco.storage import open_store

    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "how", load_config("tiny").with_overrides(
        {"run.num_learners": 1}))
    asked: list[bool] = []
    monkeypatch.setattr(api, "supervise",
                        lambda ctx, *, prefect, announce: asked.append(prefect) or "target version")
    # the summary: nothing failed
    monkeypatch.setattr(view, "final_report", lambda *a, **k: {"failure": None})

    def resume(kind: str, *flags: str) -> str:
        acquire(ctx, kind).release("interrupted")  # how the session before this one was supervised
        result = CliRunner().invoke(app, ["resume", "--storage", ctx.store.url, "--run-id", ctx.run_id,
                                          "--versions", "1", "--no-live", *flags], terminal_width=200)
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split())  # the console wraps at its width

    assert "without Prefect as it was started" in resume("local") and asked == [False]
    resume("local", "--prefect")
    resume("prefect")
    assert asked == [False, True, True]

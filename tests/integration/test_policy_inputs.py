"""Issue #44, invariant 9 — policies are generated from validated input, and a learner cannot steer the run
through what its key may write: `bucket-policy` refuses a storage URL whose bucket or prefix would widen the
ARNs (`*`, `?`, `$`, `..`) and learner names that are roles' names (also at creation and admission); under its
own policy a learner of a tiny run does everything it does, DyLU's reads of its peers' statuses included
(file:// storage, every request recorded and checked with trust.bucket_policy.allows); a status planted with a
heartbeat from the future (what a learner's key may write) no longer holds the run "live" for `resume`, and
`diloco status` shows it ignored. (The supervisor's silence check: tests/unit/test_supervisor_core.py.)

Run: .venv/bin/pytest tests/integration/test_policy_inputs.py -q (about 15 s)
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
from test_bucket_policy import Recorder
from trust_helpers import one_round, tiny_run
from typer.testing import CliRunner

from diloco.api.operate import prepare_resume, run_state
from diloco.cli import app
from diloco.configs import load_config
from diloco.learner.learner import Learner
from diloco.run.context import RunError
from diloco.run.create import create_run
from diloco.run.events import EventLog
from diloco.run.signals import request_stop
from diloco.storage import open_store
from diloco.storage.keys import InvalidName
from diloco.storage.records import LearnerStatus, read_record, write_record
from diloco.trust.bucket_policy import allows, policy_for

UNSAFE = ["s3://rt*/runs", "s3://b?t/runs", "s3://Bkt/runs", "s3://bkt/runs/*", "s3://bkt/a/../runs",
          "s3://bkt/${aws:username}/runs", "s3://bkt/a//runs", "s3://bkt/r?ns", "s3://bkt..x/runs"]
ROLE_NAMES = ["merger", "merger-s1", "evaluator", "operator", "supervisor", "chaos"]


def _one_line_exit_2(args: list[str], why: str) -> None:
    result = CliRunner().invoke(app, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and why in lines[0], (args, result.output)


def test_policies_and_names_come_only_from_validated_input(tmp_path: Path) -> None:
    for storage in UNSAFE:
        _one_line_exit_2(["bucket-policy", "--storage", storage, "--run-id", "r", "--role", "merger"],
                         "--storage")
    for name in ROLE_NAMES:
        _one_line_exit_2(["bucket-policy", "--storage", "s3://bkt/runs", "--run-id", "r", "--learner", name],
                         "is reserved")
    policy = policy_for("s3://bkt/team-a/runs", "r", learner="us-east-0")  # the honest ones
    assert allows(policy, "s3:PutObject", "bkt", "team-a/runs/r/learners/us-east-0/status.json")

    ctx, learners, merger = tiny_run(tmp_path)
    for name in ROLE_NAMES:
        _one_line_exit_2(["admit-learner", "--storage", ctx.store.url, "--run-id", ctx.run_id,
                          "--learner", name], "is reserved")
    store = open_store(f"file://{tmp_path}/bucket")
    with pytest.raises(InvalidName, match="reserved"):
        create_run(store, "named", load_config("tiny"), learners=["us-east-0", "evaluator"])
    with pytest.raises(InvalidName, match="reserved"):  # merger-0 would write a second merger's events
        create_run(store, "prefixed", load_config("tiny").with_overrides({"run.learner_prefix": "merger"}))
    assert not store.list("named/") and not store.list("prefixed/")
    for learner in learners:
        learner.close()


def test_a_learner_does_all_it_does_under_its_policy_dylu_included(tmp_path: Path) -> None:
    cfg = load_config("tiny").with_overrides({"run.num_learners": 2, "learner.local_state_every_steps": 0})
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "dylu", cfg)
    assert ctx.cfg.inner.dylu
    logs, learners = {}, []
    for name in ctx.learners:
        recorder = Recorder(ctx.store)
        logs[name] = recorder.log
        events = EventLog(recorder, ctx.keys, name)
        learners.append(Learner(dataclasses.replace(ctx, store=recorder), name, events=events))
    for learner in learners:
        learner.join()
    for learner in learners:
        stats = learner.run_phase()
        learner.publish()
        learner.publisher.drain()
        learner.pace.observe(stats.steps, stats.compute_s)
        learner.heartbeat(force=True, wait=True)  # its status now reports its compute speed (learner.loop)
    for learner in learners:
        learner.pace.refresh()  # DyLU: the fastest live peer's speed, from the peer's status.json
        assert learner.pace.peers_steps_per_s, "DyLU read no peer"
        learner.close()
    for name, log in logs.items():
        policy = policy_for("s3://bkt/runs", ctx.run_id, learner=name)
        peers = [r for r in log if r[0] == "s3:GetObject" and "/learners/" in r[1] and name not in r[1]]
        denied = sorted({r for r in log
                         if not allows(policy, r[0], "bkt", "runs/" + r[1], if_none_match=len(r) > 2)})
        assert peers and denied == [], (name, denied)


def _beat(ctx, learner: str, t: float) -> None:
    status = read_record(ctx.store, ctx.keys.status(learner), LearnerStatus)
    write_record(ctx.store, ctx.keys.status(learner), status.model_copy(update={"t": t, "state": "training"}))


def test_a_heartbeat_from_the_future_no_longer_holds_the_run(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path, **{"run.num_versions": 5})
    one_round(learners, merger)
    for learner in learners:
        learner.close()
    _beat(ctx, "local-1", time.time() - 3600)  # its roles are gone: their last beats are old
    _beat(ctx, "local-0", time.time() + 5)  # a clock a few seconds ahead: an honest beat, the run is live
    assert run_state(ctx) == "live"
    with pytest.raises(RunError, match="is live"):
        prepare_resume(ctx, None, versions=1)

    _beat(ctx, "local-0", time.time() + 3 * 86400)  # the attack: its own key writes a beat 3 days ahead
    assert run_state(ctx) == "idle"
    status = CliRunner().invoke(app, ["status", "--storage", ctx.store.url, "--run-id", ctx.run_id, "--json"])
    (row,) = [r for r in json.loads(status.output)["learners"] if r["learner"] == "local-0"]
    assert "age_s" not in row and row["ahead_s"] > 2 * 86400
    table = CliRunner().invoke(app, ["status", "--storage", ctx.store.url, "--run-id", ctx.run_id],
                               terminal_width=200)
    said = " ".join(table.output.split())  # the console wraps at its width
    assert "heartbeats from the future, ignored: local-0 (259" in said and " future " in said, table.output
    request_stop(ctx, "operator")  # a stopped run resumes at once: the future beat is no role still ending
    plan = prepare_resume(ctx, None, versions=1, wait_s=1.0)
    assert plan["state"] == "stopped" and not ctx.store.exists(ctx.keys.stop())

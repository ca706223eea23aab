"""`diloco bucket-policy` against what the roles really do: a tiny signed run on the S3 test server (moto),
every request of each learner, the merger and the evaluator recorded, and each one checked against that
role's policy (an exclusive create as a request with If-None-Match); a learner's policy allows none of
another learner's writes, and neither a learner's nor the merger's allows overwriting what it created
exclusively (its deltas, the manifests); the gc role's retention (`diloco gc --keep-versions`) and orphan
collection stay within its policy. (moto does not enforce IAM conditions, so the policies are evaluated
here by diloco.trust.bucket_policy.allows, IAM's matching rules for Allow statements: `*` across `/`,
s3:prefix for listings; an exists() counts as a HEAD plus the listing of `<key>/` that s3fs falls back to.)

Run: .venv/bin/pytest tests/integration/test_bucket_policy.py -q
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from diloco.cli import app
from diloco.configs import load_config
from diloco.evaluator.evaluator import Evaluator
from diloco.inspect.audit import audit_run
from diloco.inspect.gc import collect_orphans, retain
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.context import open_run
from diloco.run.controls import membership
from diloco.run.create import create_run
from diloco.run.events import EventLog
from diloco.storage import open_store
from diloco.storage.wrapper import WrapperStore
from diloco.trust.bucket_policy import DELETE, LIST, READ, WRITE, allows, policy_for, split_s3
from diloco.trust.signing import new_key

pytestmark = pytest.mark.s3


class Recorder(WrapperStore):
    """Records (action, store key) of every request, an exclusive create as (WRITE, key, "if-none-match");
    with_retries shares the record."""

    def __init__(self, inner, log: list[tuple[str, ...]] | None = None) -> None:
        super().__init__(inner)
        self.log = [] if log is None else log

    def _over(self, inner):
        return Recorder(inner, self.log)

    def get(self, key):
        self.log.append((READ, key))
        return super().get(key)

    def get_size(self, key):
        self.log.append((READ, key))
        return super().get_size(key)

    def exists(self, key):
        self.log += [(READ, key), (LIST, key + "/")]
        return super().exists(key)

    def put(self, key, data):
        self.log.append((WRITE, key))
        super().put(key, data)

    def put_if_absent(self, key, data):
        self.log.append((WRITE, key, "if-none-match"))
        super().put_if_absent(key, data)

    def list(self, prefix, after=""):
        self.log.append((LIST, prefix))
        return super().list(prefix, after)

    def folders(self, prefix):
        self.log.append((LIST, prefix))
        return super().folders(prefix)

    def sizes(self, prefix):
        self.log.append((LIST, prefix))
        return super().sizes(prefix)

    def delete(self, key):
        self.log.append((DELETE, key))
        super().delete(key)


def test_every_request_of_every_role_is_allowed_by_its_policy_and_no_more(s3_url: str) -> None:
    cfg = load_config("tiny").with_overrides({"run.num_learners": 2, "merger.quorum": 2,
                                              "merger.grace_cap_s": 0.0, "learner.sign": True,
                                              "learner.local_state_every_steps": 0,
                                              "state.checkpoint_every": 1})  # the merger's checkpoints too
    store = open_store(s3_url)
    ctx = create_run(store, "pol", cfg)
    keys = {n: new_key().encode() for n in ctx.learners}
    logs: dict[str, list] = {}

    def as_role(name: str):
        recorder = Recorder(open_store(s3_url))
        logs[name] = recorder.log
        opened = open_run(recorder, ctx.run_id)  # what a role's process does first
        membership(recorder, ctx.keys, opened.learners)
        return dataclasses.replace(opened, store=recorder)

    learners = []
    for n in ctx.learners:
        lctx = as_role(n)
        learners.append(Learner(lctx, n, events=EventLog(lctx.store, lctx.keys, n), signing_key=keys[n]))
    mctx = as_role("merger")
    merger = Merger(mctx, events=EventLog(mctx.store, mctx.keys, "merger"),
                    keyring={n: [k] for n, k in keys.items()})
    for learner in learners:
        learner.join()
    merger.load()
    for _ in range(2):
        for learner in learners:
            learner.run_phase()
            learner.publish()
            learner.publisher.drain()
            learner.flush_events()
        assert merger.merge_once() is not None
        merger.events.flush()
        for learner in learners:
            learner.maybe_install()
    # issue #44, invariant 6: the manifest a learner reads publishes no window; the merger keeps it in guard/
    seen = learners[0].ctx.store.get(ctx.keys.manifest(merger.version))
    assert b'"norms"' not in seen and b"outlier_" not in seen and b'"window"' in seen
    for learner in learners:
        learner.close()
    ectx = as_role("evaluator")
    evaluator = Evaluator(ectx, events=EventLog(ectx.store, ectx.keys, "evaluator"))
    evaluator.evaluate_version(0)
    evaluator.evaluate_version(merger.version)
    evaluator.events.flush()
    merger.close()
    gctx = as_role("gc")
    # version 2 names checkpoint 1: checkpoint 0, update 1 and round 1's deltas go
    kept = retain(gctx, keep_versions=1, by="ops")
    assert kept.history_from == [1] and any("/deltas/" in k for k in kept.deleted) and audit_run(gctx).ok
    collect_orphans(gctx, min_age_s=0)

    bucket, prefix = split_s3(s3_url)
    for name, log in logs.items():
        role = name if name in ("merger", "evaluator", "gc") else None
        policy = policy_for(s3_url, ctx.run_id, learner=None if role else name, role=role)
        denied = sorted({r for r in log
                         if not allows(policy, r[0], bucket, prefix + r[1], if_none_match=len(r) > 2)})
        assert denied == [], f"{name}: {denied}"
        assert any(r[0] == WRITE for r in log), name
        # what is history (a delta, a manifest) was created exclusively, and its overwrite is not allowed
        once = {r[1] for r in log if len(r) > 2}
        assert (name in ("evaluator", "gc") or once) and \
            not any(allows(policy, WRITE, bucket, prefix + k) for k in once), name
    guard = prefix + ctx.keys.guard_prefix()
    assert any(r[0] == WRITE and len(r) > 2 and (prefix + r[1]).startswith(guard) for r in logs["merger"])
    for name in (*ctx.learners, "evaluator"):  # nobody judged reads the window, nor may
        assert not any((prefix + r[1]).startswith(guard) for r in logs[name]), name
        policy = policy_for(s3_url, ctx.run_id, learner=None if name == "evaluator" else name,
                            role="evaluator" if name == "evaluator" else None)
        window = prefix + merger.manifest.guard.window.key
        assert not allows(policy, READ, bucket, window) and not allows(policy, LIST, bucket, guard), name
    a, b = ctx.learners
    writes_of_b = {r[1] for r in logs[b] if r[0] == WRITE}
    assert writes_of_b and not any(allows(policy_for(s3_url, ctx.run_id, learner=a), WRITE, bucket,
                                          prefix + k, if_none_match=True) for k in writes_of_b)
    printed = CliRunner().invoke(app, ["bucket-policy", "--storage", s3_url, "--run-id", ctx.run_id,
                                       "--learner", a])
    assert printed.exit_code == 0 and json.loads(printed.output) == policy_for(s3_url, ctx.run_id, learner=a)

"""Issue #44, invariant 8 — run.json is pinned: version 0 records its checksum at creation; when run.json is
overwritten in the middle of a live tiny run (real learners and merger, file:// storage), every process that
opens the run refuses it with one line naming run.json (a learner's or merger's start, `status`, `resume`),
`audit` says "run.json changed since creation" instead of hundreds of replay differences, and the original
bytes put back make the run whole again; a run created before the pin (version 0 without a checksum) still
opens and audits, and says it is not pinned. The bucket policies make run.json write-once for every role
(tests/unit/test_signing_and_policy.py).

Run: .venv/bin/pytest tests/integration/test_run_json_pin.py -q (about 15 s)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trust_helpers import one_round, tiny_run
from typer.testing import CliRunner

from diloco.cli import app
from diloco.inspect.audit import audit_run
from diloco.launch import make_learner, make_merger
from diloco.run.context import RunError, open_run
from diloco.run.pin import PINNED
from diloco.storage import read_manifest
from diloco.storage.codec import object_checksum


def _cli(ctx, *args: str):
    return CliRunner().invoke(app, [args[0], "--storage", ctx.store.url, "--run-id", ctx.run_id, *args[1:]])


def test_run_json_edited_mid_run_is_named_by_every_reader_and_its_bytes_put_back_heal(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path)
    one_round(learners, merger)
    key = ctx.keys.run_json()
    original = ctx.store.get(key)
    assert read_manifest(ctx.store, ctx.keys, 0).run_json_checksum == object_checksum(original)
    assert open_run(ctx.store, ctx.run_id).pin == PINNED

    edited = json.loads(original)
    edited["config"]["outer"]["lr"] = 0.35  # a plausible edit: every later merge would replay differently
    ctx.store.put(key, json.dumps(edited, indent=1).encode())
    one_round(learners, merger)  # the live roles read run.json at their start: they go on

    with pytest.raises(RunError, match="run.json changed since creation"):
        open_run(ctx.store, ctx.run_id)
    for start in (make_learner, make_merger):  # a restarted role refuses the run before it trains or merges
        with pytest.raises(RunError, match="run.json changed since creation"):
            start(ctx.store.url, ctx.run_id, *(["local-0"] if start is make_learner else []))
    for args in (["status"], ["resume", "--versions", "1", "--no-prefect"], ["set", "outer.lr=0.5"]):
        result = _cli(ctx, *args)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1, (args, result.output)
        assert "run.json changed since creation" in lines[0], args

    audited = _cli(ctx, "audit")
    assert audited.exit_code == 1 and "run.json changed since creation" in audited.output, audited.output
    problems = [line for line in audited.output.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1 and "replay skipped" in problems[0], audited.output  # not one line per version

    ctx.store.put(key, original)  # the original bytes put back: the run is whole again
    for learner in learners:
        learner.close()
    report = audit_run(open_run(ctx.store, ctx.run_id))
    assert report.ok and report.replay_ok and report.num_versions == 3, report.problems
    assert report.run_json == PINNED


def test_a_run_created_before_the_pin_still_opens_and_says_so(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path)
    one_round(learners, merger)
    for learner in learners:
        learner.close()
    v0 = json.loads(ctx.store.get(ctx.keys.manifest(0)))
    del v0["run_json_checksum"]  # what version 0 of a run created before the pin holds
    ctx.store.put(ctx.keys.manifest(0), json.dumps(v0, sort_keys=True, indent=1).encode())
    old = open_run(ctx.store, ctx.run_id)
    assert old.pin.startswith("not pinned") and audit_run(old).ok
    audited = _cli(ctx, "audit")
    assert audited.exit_code == 0 and "note: run.json not pinned" in audited.output, audited.output


@pytest.mark.parametrize("fragments", [1, 3])
def test_a_fork_is_pinned_as_it_is_written(tmp_path: Path, fragments: int) -> None:
    from diloco.configs import load_config
    from diloco.inspect.fork import fork_run
    from diloco.run.create import create_run
    from diloco.storage import open_store

    parent = create_run(open_store(f"file://{tmp_path}/bucket"), "parent",
                        load_config("tiny").with_overrides({"fragments.count": fragments}))
    child = fork_run(parent.store, "parent", 0, "child")
    assert child.pin == "pinned by version 0" and audit_run(child).run_json == "pinned by version 0"

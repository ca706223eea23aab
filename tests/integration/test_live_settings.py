"""Issue #44, invariant 7 — live settings are validated by type and round-trip exactly: on a tiny run whose
merger runs in a thread (real learners publishing meanwhile, file:// storage), every operator input that broke
a live run (`.inf`, `1e400`, `nan`, `quorum=true`, a poll too long to see the next op, a `max_delta_bytes`
below the deltas the run sends) is one line, exit 2, nothing filed; an op file planted with `Infinity` is
refused by the merger, which merges on; honest values as docs/TRUST.md spells them (`outlier_rule=off`) are
filed, recorded and replayed by audit byte for byte; `--force` sets a harmful value on purpose; removing the
last member is refused.

Run: .venv/bin/pytest tests/integration/test_live_settings.py -q (about 20 s)
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from trust_helpers import publish_all, tiny_run
from typer.testing import CliRunner

from diloco.cli import app
from diloco.inspect.audit import audit_run
from diloco.merger.loop import ShardMerger, run_merger
from diloco.run.context import open_run
from diloco.run.controls import list_ops
from diloco.storage import Manifest, latest_version, read_manifest

ATTACKS = [  # (the arguments of `diloco set`, what the one line must say)
    (["merger.poll_interval_s=.inf"], "merger.poll_interval_s='.inf': must be a finite number"),
    (["merger.quorum_timeout_s=1e400"], "merger.quorum_timeout_s='1e400': must be a finite number"),
    (["merger.gap_timeout_s=nan"], "merger.gap_timeout_s='nan': must be a finite number"),
    (["merger.quorum=true"], "merger.quorum='true': must be an integer"),
    (["merger.outlier_rule=false"], "merger.outlier_rule='false': must be one of reject, clip, off"),
    (["merger.poll_interval_s=1e9"], "merger.poll_interval_s=1000000000.0: at most 60"),
    (["merger.max_delta_bytes=1000"], "would be rejected as oversized"),
    (["outer.lr=0.5", "merger.quorum=2.5"], "merger.quorum='2.5': must be an integer"),  # nothing set
]


def _wait(check, timeout_s: float = 30.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if result := check():
            return result
        time.sleep(0.1)
    raise AssertionError("timed out")


def _next_manifest(ctx, after: int) -> Manifest:
    def newer() -> Manifest | None:
        version = latest_version(ctx.store, ctx.keys)
        return read_manifest(ctx.store, ctx.keys, version) if version > after else None

    return _wait(newer)


def _cli(ctx, *args: str):
    return CliRunner().invoke(app, [args[0], "--storage", ctx.store.url, "--run-id", ctx.run_id, *args[1:]])


def test_inputs_that_broke_a_live_run_are_refused_and_honest_ones_round_trip(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path, **{"merger.quorum": 1})
    stop = threading.Event()
    thread = threading.Thread(target=run_merger, args=(ShardMerger(ctx),),
                              kwargs={"should_stop": stop.is_set}, daemon=True)
    thread.start()
    try:
        publish_all(learners)
        first = _next_manifest(ctx, 0)
        sent = max(d.bytes for d in first.merged())
        for args, why in ATTACKS:
            result = _cli(ctx, "set", *args)
            lines = [line for line in result.output.splitlines() if line.strip()]
            assert result.exit_code == 2 and len(lines) == 1 and why in lines[0], (args, result.output)
        assert list_ops(ctx.store, ctx.keys) == [], "a refused setting filed an op"

        # a writer with the operator's key (or a bug) files an op the CLI would refuse: the merger refuses it,
        # lives on
        rogue = f"{time.time_ns():020d}-0badf00d"
        ctx.store.put_if_absent(ctx.keys.op(rogue), b'{"kind": "set", "t": 1.0, "by": "rogue", "values": '
                                                    b'{"merger.poll_interval_s": Infinity}}')
        honest = _cli(ctx, "set", "merger.outlier_rule=off", "merger.quorum=2", "outer.lr=0.5")
        assert honest.exit_code == 0 and "merger.outlier_rule='off'" in honest.output, honest.output
        (op,) = [name for name in list_ops(ctx.store, ctx.keys) if name != rogue]
        filed = ctx.store.get(ctx.keys.op(op))
        honest_values = {"merger.outlier_rule": "off", "merger.quorum": 2, "outer.lr": 0.5}
        assert json.loads(filed)["values"] == honest_values and b"Infinity" not in filed
        publish_all(learners)
        m = _wait(lambda: (x := _next_manifest(ctx, first.version)).controls and x)
        assert thread.is_alive(), "the merger died"
        entries = {e.name: e for e in m.controls}
        assert entries[rogue].kind == "invalid" and "not a finite value" in entries[rogue].refused
        assert entries[op].refused == "" and entries[op].values == json.loads(filed)["values"]
        assert m.guard.settings == honest_values

        # on purpose: --force sets what would reject every delta the run sends, and the merger does just that
        forced = _cli(ctx, "set", "merger.max_delta_bytes=1000", "--force", "--reason", "drill")
        assert forced.exit_code == 0, forced.output
        publish_all(learners)
        m = _wait(lambda: (x := _next_manifest(ctx, m.version)).controls and x)
        assert m.decisions and all(d.check == "size" for d in m.decisions) and sent > 1000
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()

    assert _cli(ctx, "remove-learner", "--learner", "local-1").exit_code == 0
    last = _cli(ctx, "remove-learner", "--learner", "local-0")
    assert last.exit_code == 2 and "last member" in last.output, last.output
    for learner in learners:
        learner.close()
    report = audit_run(open_run(ctx.store, ctx.run_id))  # replays every decision with the settings as filed
    assert report.ok and report.replay_ok and report.controls_applied == 3, report.problems

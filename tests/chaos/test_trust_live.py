"""The issue's rogue, in a live run of real processes (tiny recipe, two learners, local supervisor, no
Prefect): a well-formed, finite delta 1000x an honest one from a name the run never admitted, and the same
from a learner admitted with `diloco admit-learner`, are rejected and the committed update stays in line;
then, from the command line, the finished run is resumed for 3 more versions (seqs and cursors continue,
audit covers the whole history) and forked at version 2 (bit-equal).

Run: .venv/bin/pytest -m chaos tests/chaos/test_trust_live.py   (about 90 s on 2 cores)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chaos_harness import assert_no_children

from diloco.configs import load_config
from diloco.inspect.audit import audit_run
from diloco.run.chain_state import params_at
from diloco.run.context import open_run
from diloco.run.create import create_run
from diloco.run.fragments import manifests
from diloco.run.objects import encode_tensors, read_tensors
from diloco.storage import open_store, read_latest
from diloco.storage.keys import parse_delta_key
from diloco.storage.window import with_window
from diloco.supervise.local import local_supervisor
from diloco.trust.outliers import guard_figures

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*args: str, cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "diloco.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=ENV, timeout=timeout_s)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    return done


def plant_1000x(ctx, learner: str, base: int) -> None:
    real = sorted(k for k in ctx.store.list(ctx.keys.deltas_prefix(ctx.learners[0]))
                  if k.endswith(".delta"))[-1]
    header, delta = read_tensors(ctx.store, real)
    meta = {**header.meta, "learner": learner, "seq": 0, "base_version": base}
    ctx.store.put(ctx.keys.delta(learner, 0),
                  encode_tensors({k: v * 1000 for k, v in delta.items()}, codec_name="fp32",
                                 kind="delta", fingerprint=ctx.fingerprint, meta=meta))


def decided(ctx, learner: str):
    for m in manifests(ctx):
        for d in m.decisions:
            if d.learner == learner and d.seq == 0:
                return m.version, d
    return None


def test_a_rogue_in_a_live_run_then_resume_and_fork_from_the_cli(tmp_path: Path) -> None:
    cfg = load_config("tiny").with_overrides({"run.num_learners": 2, "run.num_versions": 1_000_000,
                                              "run.time_limit_s": 240, "run.heartbeat_timeout_s": 120})
    url = f"file://{tmp_path}/store"
    ctx = create_run(open_store(url), "live", cfg)
    sup = local_supervisor(ctx, prefect=False, log_dir=str(tmp_path / "logs"), env={"OMP_NUM_THREADS": "1"})
    state: dict = {}

    def until(s) -> bool:
        latest = read_latest(ctx.store, ctx.keys)
        if "planted" not in state:
            # the window holds enough honest deltas
            # (the operator's view of it: the window object, never the manifest)
            if latest is not None and "outlier_median" in with_window(ctx.store, ctx.keys, latest).stats:
                cli("admit-learner", "--storage", url, "--run-id", ctx.run_id, "--learner", "bad-0",
                    "--no-start", cwd=tmp_path)
                latest = read_latest(ctx.store, ctx.keys)  # the command took seconds: versions moved on
                plant_1000x(ctx, "rogue-0", latest.version)
                plant_1000x(ctx, "bad-0", latest.version)
                state["planted"] = latest.version
            return False
        return bool(decided(ctx, "rogue-0") and decided(ctx, "bad-0")
                    and latest.version >= state["planted"] + 3)

    assert sup.run_to_end(shutdown_grace_s=30, tick_s=0.2, until=until) == "done"
    (_, rogue), (_, bad) = decided(ctx, "rogue-0"), decided(ctx, "bad-0")
    assert (rogue.status, rogue.check) == ("rejected", "admission"), rogue
    assert (bad.status, bad.check) == ("rejected", "outlier"), bad
    chain = manifests(ctx)
    before = [m.stats["update_norm"] for m in chain[1:state["planted"] + 1]]
    after = [m.stats["update_norm"] for m in chain[state["planted"] + 1:]]
    assert max(after) < 3 * max(before), (before, after)
    assert guard_figures(ctx)["guard_rejections"] == 0  # the run's own learners: no false rejection
    assert audit_run(open_run(url, ctx.run_id)).ok
    assert_no_children()

    finished = chain[-1].version
    seqs = {n: max(p[1] for p in map(parse_delta_key, ctx.store.list(ctx.keys.deltas_prefix(n))) if p)
            for n in ctx.learners}
    out = cli("resume", "--storage", url, "--run-id", ctx.run_id, "--versions", "3", "--no-prefect",
              "--no-live", "--json", cwd=tmp_path)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["num_versions"] >= finished + 3, summary
    for n in ctx.learners:  # seqs continue where they were: no reuse, no gap after the resume
        listed = sorted(p[1] for p in map(parse_delta_key, ctx.store.list(ctx.keys.deltas_prefix(n))) if p)
        assert listed == list(range(len(listed))) and listed[-1] > seqs[n], (n, seqs[n], listed[-5:])
    report = audit_run(open_run(url, ctx.run_id))
    assert report.ok and report.num_versions == summary["num_versions"] + 1, report.problems
    assert any(e.kind == "resume" for m in manifests(ctx) for e in m.controls)

    cli("fork", "--storage", url, "--run-id", ctx.run_id, "--at-version", "2", "--new-run-id", "live-fork",
        cwd=tmp_path)
    child = open_run(url, "live-fork")
    theirs, ours = params_at(ctx, 2)[0], params_at(child, 0)[0]  # each from its checkpoint and updates
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    assert_no_children()

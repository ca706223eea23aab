"""Buffers reach the model that is evaluated and exported (outer.buffers: mean): a user's MLP with BatchNorm
trained by two in-process learners scores its held-out metric like the same MLP without BatchNorm, while
`outer.buffers: keep` (the behaviour before buffers were merged: the evaluator's model keeps the initial
running statistics) does not and is warned once at creation; audit replays the merged buffers bit for bit; the
safetensors export, the sampled model, a fork and a (re)joining learner carry the version's buffers; a delta
with missing or wrong buffers is rejected with a reason and the merge goes on, a merge without any learner's
buffers carries its parent's forward; a fragmented run carries the buffers with fragment 0's chain; a 2-rank
learner ships rank 0's; a learner resumed from its local state keeps its own.

Run: .venv/bin/pytest tests/integration/test_buffers.py -q   (about 15 s on 2 cores: one learner process, the
rest in-process)
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bn_spec_source import BN_SPEC_SOURCE

from diloco.configs import load_config
from diloco.evaluator.evaluator import Evaluator
from diloco.inspect.audit import audit_run
from diloco.inspect.fork import fork_run
from diloco.inspect.model_out import export_safetensors, load_model
from diloco.learner.learner import Learner
from diloco.merger.loop import ShardMerger
from diloco.merger.merger import Merger
from diloco.run.buffers import run_buffers
from diloco.run.context import open_run
from diloco.run.create import create_run
from diloco.run.fragments import run_version
from diloco.run.objects import encode_shipped, read_tensors
from diloco.storage import open_store, read_latest, read_manifest
from diloco.storage.records import LearnerStatus, read_record
from diloco.training.buffers import get_buffers

ROUNDS = 8


@pytest.fixture()
def spec_path(tmp_path: Path) -> Path:
    path = tmp_path / "bnspec.py"
    path.write_text(BN_SPEC_SOURCE)
    return path


def _create(tmp_path: Path, spec_path: Path, run_id: str, *, bn: bool = True, buffers: str = "mean",
            **overrides):
    cfg = load_config("tiny").with_overrides({
        "spec": f"{spec_path}:make_spec", "spec_args": {"bn": bn}, "run.num_learners": 2, "merger.quorum": 2,
        "merger.grace_cap_s": 0.0, "inner.steps_per_phase": 10, "learner.local_state_every_steps": 0,
        "learner.checkpoint": False, "learner.codec": "int8", "outer.buffers": buffers, **overrides})
    return create_run(open_store(f"file://{tmp_path}/store"), run_id, cfg)


def _train(ctx, rounds: int = ROUNDS) -> tuple[float, float]:
    """Both learners ship a phase, the merger merges both, the learners install; (held-out at 0, at the
    end)."""
    learners = [Learner(ctx, name) for name in ctx.learners]
    for learner in learners:
        learner.join()
    merger = Merger(ctx)
    merger.load()
    for _ in range(rounds):
        for learner in learners:
            learner.publish(learner.run_phase())
            learner.publisher.drain()
        assert merger.merge_once() is not None
        for learner in learners:
            learner.maybe_install()
    own = get_buffers(learners[0].model, ctx.buffers)
    for learner in learners:
        learner.close()
    if ctx.buffers:  # installs leave a learner's own running statistics alone: it ships its own next time
        merged = run_buffers(ctx, merger.version)
        assert not torch.equal(own["body.1.running_mean"], merged["body.1.running_mean"])
    evaluator = Evaluator(ctx)
    return evaluator.evaluate_version(0)["loss"], evaluator.evaluate_version(merger.version)["loss"]


def test_batchnorm_scores_like_the_model_without_it(tmp_path, spec_path, caplog) -> None:
    plain = _train(_create(tmp_path, spec_path, "plain", bn=False))
    with caplog.at_level(logging.WARNING, logger="diloco.run"):
        kept_ctx = _create(tmp_path, spec_path, "kept", buffers="keep")
        _create(tmp_path, spec_path, "kept", buffers="keep")  # joined, not created: no second warning
    warned = [r.getMessage() for r in caplog.records if "outer.buffers is keep" in r.getMessage()]
    assert (len(warned) == 1
            and "body.1.running_mean, body.1.running_var, body.1.num_batches_tracked" in warned[0])
    kept = _train(kept_ctx)
    ctx = _create(tmp_path, spec_path, "merged")
    merged = _train(ctx)
    assert [e["name"] for e in ctx.buffers] == ["body.1.running_mean", "body.1.running_var",
                                               "body.1.num_batches_tracked"] and kept_ctx.buffers == []
    assert plain[1] < 0.2 * plain[0] and merged[1] < 0.2 * merged[0]
    assert merged[1] < 1.5 * plain[1] + 0.02  # falls like the model without BatchNorm ...
    assert kept[1] > 3 * plain[1] + 0.1  # ... which the initial running statistics cannot (the old behaviour)
    report = audit_run(ctx)
    assert report.ok and report.replay_ok and report.deltas_merged == 2 * ROUNDS, report.problems
    latest = read_latest(ctx.store, ctx.keys)
    buffers = run_buffers(ctx, latest.version)
    # the maximum of the learners' step counts
    assert buffers["body.1.num_batches_tracked"].item() == 10 * ROUNDS
    _check_readers(tmp_path, ctx, latest.version, buffers)


def _check_readers(tmp_path: Path, ctx, version: int, buffers: dict) -> None:
    """Export, load_model (sample, native export), a fork and a joining learner carry the version's
    buffers."""
    from safetensors import safe_open

    out, _ = export_safetensors(ctx, tmp_path / "model.safetensors")
    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()["buffers"]) == list(buffers)
        exported = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iteration
    assert exported["body.1.num_batches_tracked"].dtype == torch.int64
    assert all(torch.equal(exported[k].float(), v) for k, v in buffers.items())
    _, model, _ = load_model(ctx)
    assert torch.equal(model.body[1].running_var, buffers["body.1.running_var"])
    child = fork_run(ctx.store, ctx.run_id, version, "child")
    assert child.buffers == ctx.buffers and torch.equal(run_buffers(child, 0)["body.1.running_mean"],
                                                        buffers["body.1.running_mean"])
    joined = Learner(ctx, "late-0")  # a learner joining (or rejoining) from the bucket takes the version's
    joined.join()
    assert torch.equal(joined.model.body[1].running_mean, buffers["body.1.running_mean"])
    joined.close()


def _put_delta(ctx, learner: str, seq: int, buffers: dict | None, codec: str = "int8") -> None:
    """A delta of `learner` on version 0 (a small step of every parameter), with these buffers."""
    layout = {e["name"]: torch.full(e["shape"], 1e-3) for e in ctx.layout}
    meta = {"learner": learner, "seq": seq, "base_version": 0, "tokens": 320, "steps": 10}
    data, _ = encode_shipped(layout, codec_name=codec, kind="delta", fingerprint=ctx.fingerprint, meta=meta,
                             buffers=buffers)
    ctx.store.put(ctx.keys.delta(learner, seq), data)


def test_bad_buffers_are_rejected_and_a_merge_without_any_carries_them_forward(tmp_path, spec_path) -> None:
    ctx = _create(tmp_path, spec_path, "bad", **{"merger.quorum": 1, "merger.quorum_timeout_s": 0.1})
    good = {"body.1.running_mean": torch.linspace(-1, 1, 32), "body.1.running_var": torch.linspace(1, 9, 32),
            "body.1.num_batches_tracked": torch.tensor(42.0)}
    _put_delta(ctx, "local-0", 0, good)
    _put_delta(ctx, "local-1", 0, None)  # no buffers
    _put_delta(ctx, "local-1", 1, {**good, "body.1.running_var": torch.ones(31)})  # a wrong shape
    merger = Merger(ctx)
    merger.load()
    first = merger.merge_once()
    reasons = {d.seq: d.reason for d in first.rejected()}
    assert [d.learner for d in first.merged()] == ["local-0"]
    assert "carries 0 buffers where the run merges 3" in reasons[0] and "of shape [31]" in reasons[1]
    # one learner: its own, exactly
    assert all(torch.equal(run_buffers(ctx, 1)[k], v) for k, v in good.items())
    _put_delta(ctx, "local-1", 2, {**good, "body.1.running_mean": torch.full((32,), float("nan"))})
    second = merger.merge_once()  # every delta rejected: the version carries its parent's buffers
    assert not second.merged() and "non-finite" in second.rejected()[0].reason
    assert second.buffers_key != first.buffers_key and second.buffers_checksum == first.buffers_checksum
    report = audit_run(ctx)
    assert report.ok and report.replay_ok and report.decisions_replayed == 4, report.problems


def test_a_fragmented_run_carries_buffers_with_fragment_zero(tmp_path, spec_path) -> None:
    ctx = _create(tmp_path, spec_path, "frag", **{"fragments.count": 2, "fragments.overlap_steps": 1})
    learners = [Learner(ctx, name) for name in ctx.learners]
    for learner in learners:
        learner.publisher.full = lambda *_: False  # every fragment ships when due (these tests count merges)
        learner.join()
    shard = ShardMerger(ctx, 0)
    for _ in range(ROUNDS):
        for learner in learners:
            learner.run_phase()
            learner.drain()
        for _ in range(4):
            shard.poll_once()
    for learner in learners:
        learner.close()
    version = run_version(ctx)
    assert version >= ROUNDS - 1
    zero, one = (read_manifest(ctx.store, ctx.keys.for_fragment(p), version) for p in (0, 1))
    assert zero.buffers_key.startswith(f"{ctx.run_id}/fragments/0000/global/") and not one.buffers_key
    evaluator = Evaluator(ctx)
    start, end = evaluator.evaluate_version(0)["loss"], evaluator.evaluate_version(version)["loss"]
    assert end < 0.2 * start, (start, end)  # with the initial running statistics it stays near 1.2 (above)
    report = audit_run(ctx)
    assert report.ok and report.replay_ok, report.problems
    out, _ = export_safetensors(ctx, tmp_path / "frag.safetensors")
    from safetensors.torch import load_file

    assert load_file(str(out))["body.1.num_batches_tracked"].item() == run_buffers(ctx, version)[
        "body.1.num_batches_tracked"].item() > 0


def test_a_learner_resumed_from_its_local_state_keeps_its_own_buffers(
        tmp_path, spec_path, monkeypatch) -> None:
    monkeypatch.setenv("DILOCO_LOCAL_DIR", str(tmp_path / "local"))
    ctx = _create(tmp_path, spec_path, "local", **{"learner.local_state_every_steps": 5})
    first = Learner(ctx, "local-0")
    first.join()
    first.publish(first.run_phase())
    first.publisher.drain()
    first.local.flush()
    own = get_buffers(first.model, ctx.buffers)
    first.publisher.abandon()  # a crash: the state on this host is what the next process finds
    second = Learner(ctx, "local-0")
    second.join()
    assert all(torch.equal(get_buffers(second.model, ctx.buffers)[k], v) for k, v in own.items())
    assert own["body.1.num_batches_tracked"].item() == 10  # its own, not version 0's initial ones
    second.close()


def test_a_two_rank_learner_ships_rank_zeros_buffers(tmp_path, spec_path) -> None:
    ctx = _create(tmp_path, spec_path, "ranks",
                  **{"learner.ranks": 2, "run.num_learners": 1, "merger.quorum": 1})
    done = subprocess.run([sys.executable, "-m", "diloco.launch", "learner", "--storage", ctx.store.url,
                           "--run-id",
                           "ranks", "--name", "local-0", "--phases",
                           "2"], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    header, delta = read_tensors(ctx.store, ctx.keys.delta("local-0", 1))
    # rank 0's own steps
    assert header.meta["buffers"] == 3 and delta["body.1.num_batches_tracked"].item() == 20
    assert read_record(ctx.store, ctx.keys.status("local-0"), LearnerStatus).ranks == 2
    merger = Merger(ctx)
    merger.load()
    assert [d.seq for d in merger.merge_once().merged()] == [0, 1]
    assert torch.equal(run_buffers(ctx, 1)["body.1.running_mean"], delta["body.1.running_mean"])


def test_a_run_made_before_buffers_were_merged_runs_as_before(tmp_path, spec_path) -> None:
    ctx = _create(tmp_path, spec_path, "old")
    record = json.loads(ctx.store.get(ctx.keys.run_json()))
    del record["buffers"]  # what older code wrote: no buffers list
    ctx.store.put(ctx.keys.run_json(), json.dumps(record).encode())
    v0 = json.loads(ctx.store.get(ctx.keys.manifest(0)))
    del v0["run_json_checksum"]  # nor did it pin run.json in version 0 (diloco.run.pin)
    ctx.store.put(ctx.keys.manifest(0), json.dumps(v0, sort_keys=True, indent=1).encode())
    old = open_run(ctx.store, "old")
    # the layout's fingerprint: buffers never in it
    assert old.buffers == [] and old.fingerprint == ctx.fingerprint
    _train(old, rounds=2)
    header, _ = read_tensors(old.store, old.keys.delta("local-0", 1))
    assert "buffers" not in header.meta and all(t.codec is None for t in header.tensors)
    manifest = json.loads(old.store.get(old.keys.manifest(2)))
    assert "buffers_key" not in manifest and "buffers_checksum" not in manifest
    report = audit_run(old)
    assert report.ok and report.replay_ok, report.problems

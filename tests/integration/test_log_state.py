"""The log and its checkpoints (issue #41, docs/STORAGE.md): a version writes its update and manifest, a
chain's full state only every `state.checkpoint_every` versions; every reader rebuilds a version from the
checkpoint at or before it and the updates after it, and a merger its state from the checkpoint and the
merges after it, replayed.

Checked here, on tiny runs driven in one process in a fixed order (the committed bits depend only on the
seed): replay from checkpoint + log is bit for bit the run that wrote its full state every version (K = 1),
at P = 1 and P = 2; a merger killed after a commit, mid-checkpoint (after one part of several) or after the
checkpoint landed unnamed, a merger that lost a commit race, and one restarted far behind rebuild the state
and commit what an undisturbed run commits; a learner joins at every offset from a checkpoint (and a
far-behind one catches up) with the merger's exact bits; the evaluator follows the updates; gc's retention
keeps what the kept versions need (rejoin, a merger's restart, audit of the kept history, export) and
refuses what it removed by name; a replay that does not make the committed update stops the merger; a run
of the format before the log (storage format 1, tests/integration/data/format1) still audits, exports,
forks and merges on; a checkpoint's parts split a tensor, and a damaged part, or one whose values do not
fill its slices, is named.

Run: .venv/bin/pytest tests/integration/test_log_state.py -q   (about a minute)
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

import diloco.run.checkpoint as checkpoint_module
from diloco.configs import load_config
from diloco.inspect.audit import audit_run
from diloco.inspect.fork import fork_run
from diloco.inspect.gc import collect_orphans, retain
from diloco.inspect.model_out import version_params
from diloco.learner.learner import Learner
from diloco.learner.prefetch import fetch_global
from diloco.merger.loop import ShardMerger
from diloco.merger.replay import ReplayMismatch, recover
from diloco.run.chain_state import ChainFollower, chain_params, params_at
from diloco.run.checkpoint import checkpoint_of, plan_parts, read_checkpoint, write_checkpoint
from diloco.run.context import RunContext, RunError, open_run
from diloco.run.create import create_run
from diloco.run.fragments import chain_contexts
from diloco.run.objects import CorruptObject, encode_tensors
from diloco.storage import list_versions, open_store, read_manifest
from diloco.storage.codec import object_checksum
from diloco.storage.manifest import CheckpointRef
from diloco.storage.records import RetentionRecord, RunRecord, read_record

OVERRIDES = {"run.num_learners": 2, "merger.quorum": 2, "inner.steps_per_phase": 8,
             "learner.probe_every_steps": 4,
             "inner.dylu": False, "learner.local_state_every_steps": 0, "learner.prefetch": False,
             "learner.checkpoint": False, "outer.momentum": 0.5, "outer.update_codec": "int4",
             "learner.codec": "int4"}
FORMAT1 = Path(__file__).with_name("data") / "format1"


class Killed(Exception):
    """A merger killed at a stage (raised by its stage hook)."""


class Run:
    """A tiny run driven in a fixed order: each learner's phase in turn, then every waiting delta merged."""

    def __init__(self, root: Path, run_id: str, every: int, fragments: int = 1, **overrides) -> None:
        cfg = load_config("tiny").with_overrides({**OVERRIDES, "state.checkpoint_every": every,
                                                  "fragments.count": fragments, **overrides})
        url = f"file://{root}/{run_id}"
        create_run(open_store(url), run_id, cfg)
        self.ctx = open_run(url, run_id)
        self.learners = [Learner(self.ctx, name) for name in self.ctx.learners]
        for learner in self.learners:
            learner.publisher.full = lambda *_: False
            learner.join()
        self.merger = ShardMerger(self.ctx, 0)

    def publish(self) -> None:
        for learner in self.learners:
            learner.publish(learner.run_phase())
            learner.drain() if self.ctx.fragments else learner.publisher.drain()

    def merge(self, merger: ShardMerger | None = None, flush: bool = True) -> None:
        merger = merger or self.merger
        assert merger.merge_waiting() >= 1
        if flush:  # the checkpoint started by this round lands before the next (deterministic refs)
            for chain in merger.chains.values():
                chain.checkpoints.flush()
        for learner in self.learners:
            learner.maybe_install()

    def rounds(self, count: int) -> None:
        for _ in range(count):
            self.publish()
            self.merge()

    def close(self) -> None:
        for learner in self.learners:
            learner.close()
        self.merger.close()


def updates(ctx: RunContext) -> list[list[str]]:
    """Every chain's committed update checksums, by version."""
    return [[read_manifest(ctx.store, c.keys, v).update_checksum for v in list_versions(ctx.store, c.keys)]
            for c in chain_contexts(ctx)]


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fragments", [1, 2])
def test_replay_from_checkpoints_is_bit_exact_against_full_state_every_version(tmp_path: Path,
                                                                               fragments: int) -> None:
    full, log = Run(tmp_path, "full", 1, fragments), Run(tmp_path, "log", 3, fragments)
    for run in (full, log):
        run.rounds(7)
        run.close()
    assert updates(full.ctx) == updates(log.ctx)
    for f, (theirs, ours) in enumerate(zip(chain_contexts(full.ctx), chain_contexts(log.ctx), strict=True)):
        newest = list_versions(ours.store, ours.keys)[-1]
        shift = f * 3 // fragments  # the chains take turns: fragment f's checkpoints are on the grid - shift
        for v in range(newest + 1):
            m = read_manifest(ours.store, ours.keys, v)
            # landed after v - 1's commit
            assert m.checkpoint.version == (max(0, (v - 1 + shift) // 3 * 3 - shift) if v else 0)
            assert not m.params_key and not m.outer_key  # no state objects per version any more
            after = read_manifest(theirs.store, theirs.keys, v + 1) if v < newest else None
            own = read_manifest(theirs.store, theirs.keys, v)
            ref = after.checkpoint if after else checkpoint_of(theirs, own, newest=True)
            assert ref.version == v  # the K = 1 run holds the full state of every version
            stored = read_checkpoint(theirs, ref)
            rebuilt = recover(ours, m, newest=False)
            assert same(stored.params, rebuilt.params) and same(stored.params, chain_params(ours, m))
            if v:
                assert same(stored.outer.to_tensors(), rebuilt.outer.to_tensors())
    report = audit_run(log.ctx)
    assert report.ok and report.replay_ok and report.versions_replayed == 7 * fragments, report.problems
    assert report.checkpoints_compared == 2 * fragments  # versions 3 and 6 against the replay


@pytest.mark.parametrize("stage", ["after_manifest", "checkpoint_part", "checkpoint_written"])
def test_a_merger_killed_around_its_checkpoint_is_rebuilt_from_the_log(tmp_path: Path, monkeypatch,
                                                                       stage: str) -> None:
    monkeypatch.setattr(checkpoint_module, "PART_BYTES", 16 << 10)  # ~6 parts: killed after the first
    reference = Run(tmp_path, "ref", 3)
    reference.rounds(6)
    reference.close()
    run = Run(tmp_path, "kill", 3)

    def hook(at: str) -> None:  # killed at `stage` of version 3 (its commit; its checkpoint, background)
        if at == stage and ("checkpoint" in at or run.merger.chains[0].version == 2):
            raise Killed(at)

    run.merger = ShardMerger(run.ctx, 0, stage_hook=hook)
    run.rounds(2)
    run.publish()
    with pytest.raises(Killed):
        run.merge()  # version 3 commits; the kill is seen at once (after_manifest) or as its checkpoint ends
    run.merger.writer.close()  # the dead merger's thread is gone too
    assert list_versions(run.ctx.store, run.ctx.keys)[-1] == 3
    for learner in run.learners:
        learner.maybe_install()
    run.merger = ShardMerger(run.ctx, 0)  # a restart
    run.rounds(3)
    run.close()
    restart = run.merger.chains[0].state.last_load
    if stage == "checkpoint_written":  # it landed, unnamed: found by one listing, nothing replayed
        assert restart.checkpoint.version == 3 and restart.replayed == 0
    else:
        assert restart.checkpoint.version == 0 and restart.replayed == 3
    assert updates(run.ctx) == updates(reference.ctx)
    report = audit_run(run.ctx)
    assert report.ok and report.replay_ok, report.problems
    orphans = collect_orphans(run.ctx, min_age_s=0)
    assert all("/checkpoints/" in k for k in orphans.deleted)
    assert (stage == "checkpoint_part") == bool(orphans.deleted)
    assert audit_run(run.ctx).ok


def test_the_loser_of_a_commit_race_rebuilds_the_winners_state(tmp_path: Path) -> None:
    reference = Run(tmp_path, "ref", 3)
    reference.rounds(5)
    reference.close()
    run = Run(tmp_path, "race", 3)
    rival = ShardMerger(run.ctx, 0, "merger-rival")
    fired = []

    def hook(stage: str) -> None:  # the rival commits version 4 while we are about to
        if stage == "before_manifest" and run.merger.chains[0].version == 3 and not fired:
            fired.append(stage)
            assert rival.merge_chain(0) is not None

    run.rounds(3)
    loser = run.merger.chain(0)
    loser.stage_hook = hook
    run.publish()
    assert loser.take_waiting() and loser.merge_once() is None  # lost: the winner's state rebuilt (log)
    assert fired and loser.version == 4 and loser.state.last_load.checkpoint.version == 3
    assert loser.state.last_load.replayed == 1
    assert read_manifest(run.ctx.store, run.ctx.keys, 4).merger_id == "merger-rival"
    for learner in run.learners:
        learner.maybe_install()
    run.rounds(1)
    run.close()
    rival.close()
    assert updates(run.ctx) == updates(reference.ctx)
    assert audit_run(run.ctx).ok


def test_a_merger_restarted_far_behind_starts_from_the_newest_checkpoint(tmp_path: Path) -> None:
    reference = Run(tmp_path, "ref", 3)
    reference.rounds(12)
    reference.close()
    run = Run(tmp_path, "behind", 3)
    run.rounds(2)
    asleep = run.merger  # stopped at version 2, holding its state, while another merger goes on
    run.merger = ShardMerger(run.ctx, 0, "merger-2")
    run.rounds(9)
    run.merger.close()
    run.merger = asleep  # back, 9 versions behind: the newest checkpoint, not 9 merges replayed from memory
    run.rounds(1)
    run.close()
    woke = asleep.chains[0].state.last_load
    assert woke.checkpoint.version == 9 and woke.replayed == 2
    assert updates(run.ctx) == updates(reference.ctx)


def test_the_evaluator_follows_the_updates_and_reads_a_checkpoint_only_far_ahead(tmp_path: Path) -> None:
    run = Run(tmp_path, "follow", 3)
    run.rounds(9)
    run.close()
    follower = ChainFollower(run.ctx, reach=3)
    for version in (0, 1, 2, 5, 6, 7, 8):  # 2 -> 5 is three updates; 0 is the first read
        manifest = read_manifest(run.ctx.store, run.ctx.keys, version)
        assert same(follower.at(manifest), chain_params(run.ctx, manifest))
    assert (follower.checkpoints_read, follower.updates_read) == (1, 8)
    assert same(follower.at(read_manifest(run.ctx.store, run.ctx.keys, 3)), params_at(run.ctx, 3)[0])
    assert follower.checkpoints_read == 2  # back in time: from a checkpoint again


def test_a_learner_joins_at_every_offset_from_a_checkpoint_with_the_mergers_bits(tmp_path: Path) -> None:
    run = Run(tmp_path, "join", 3)
    g0 = params_at(run.ctx, 0)[0]
    for version in range(1, 8):
        run.rounds(1)
        held = run.merger.chains[0].params
        late = Learner(run.ctx, "late")  # from nothing: the newest checkpoint and the updates after it
        assert late.join() == version and same(late.state.glob, held)
        late.close()
        behind, manifest = fetch_global(run.ctx, run.ctx.store, 0, g0, version, max_updates_behind=1)
        assert manifest.version == version and same(behind, held)  # far behind: the checkpoint path
    run.close()


def test_retention_keeps_what_the_kept_versions_need(tmp_path: Path) -> None:
    run = Run(tmp_path, "keep", 2)
    run.rounds(8)
    kept = {v: params_at(run.ctx, v)[0] for v in range(9)}
    sizes = sum(run.ctx.store.sizes("keep/").values())
    report = retain(run.ctx, keep_versions=3, by="test")
    record = read_record(run.ctx.store, run.ctx.keys.retention(), RetentionRecord)
    assert record.oldest == 4 == report.history_from[0]  # version 6 names checkpoint 4 (6's landed after it)
    assert report.retained_bytes > 0 and record.removed_bytes == report.retained_bytes
    record_bytes = run.ctx.store.get_size(run.ctx.keys.retention())
    assert sum(run.ctx.store.sizes("keep/").values()) == sizes - report.retained_bytes + record_bytes
    assert retain(run.ctx, keep_versions=3).retained == []  # again: nothing more to remove
    assert list_versions(run.ctx.store, run.ctx.keys) == list(range(9))  # every manifest stays
    audit = audit_run(run.ctx)
    assert audit.ok and audit.history_from == [4] and audit.versions_replayed == 4, audit.problems
    for v in range(4, 9):
        assert same(version_params(run.ctx, v)[1], kept[v])
    with pytest.raises(RunError, match="removed by gc"):
        version_params(run.ctx, 3)
    late = Learner(run.ctx, "late")
    assert late.join() == 8 and same(late.state.glob, kept[8])
    late.close()
    run.merger.close()
    run.merger = ShardMerger(run.ctx, 0)  # a restart: the newest checkpoint and the merges after it are kept
    run.rounds(1)
    run.close()
    assert audit_run(run.ctx).ok


def test_a_replay_that_does_not_make_the_committed_update_stops_the_merger(tmp_path: Path,
                                                                           monkeypatch) -> None:
    import diloco.merger.replay as replay

    run = Run(tmp_path, "drift", 10)
    run.rounds(2)
    run.close()
    real = replay.merge_config
    monkeypatch.setattr(replay, "merge_config",
                        lambda ctx, m: real(ctx, m).with_overrides({"outer.lr": 0.69}))
    with pytest.raises(ReplayMismatch, match="replay of version 1 makes another update"):
        ShardMerger(run.ctx, 0).chain(0)


@pytest.mark.parametrize("run_id", ["old-p1", "old-p2"])
def test_a_run_of_the_format_before_the_log_still_audits_exports_and_forks(tmp_path: Path,
                                                                           run_id: str) -> None:
    shutil.copytree(FORMAT1, tmp_path / "runs")
    ctx = open_run(f"file://{tmp_path}/runs", run_id)
    assert read_record(ctx.store, ctx.keys.run_json(), RunRecord).format == 1
    report = audit_run(ctx)
    chains = len(ctx.fragments) or 1
    assert report.ok and report.replay_ok and report.versions_replayed == 4 * chains, report.problems
    assert report.checkpoints_compared == 4 * chains  # every version's params and outer objects vs the replay
    for chain in chain_contexts(ctx):
        m = read_manifest(ctx.store, chain.keys, 2)
        assert m.schema_version == 1 and m.params_key and chain_params(chain, m) is not None
    child = fork_run(ctx.store, run_id, 2, f"{run_id}-fork")
    assert read_record(child.store, child.keys.run_json(), RunRecord).format == 2
    assert same(version_params(child, 0)[1], version_params(ctx, 2)[1]) and audit_run(child).ok
    old = Run.__new__(Run)  # the old run goes on under this code: its merges write the log
    old.ctx = open_run(f"file://{tmp_path}/runs", run_id)
    old.learners = [Learner(old.ctx, name) for name in old.ctx.learners]
    for learner in old.learners:
        learner.publisher.full = lambda *_: False
        assert learner.join() == 4
    old.merger = ShardMerger(old.ctx, 0)
    old.rounds(2)
    old.close()
    head = read_manifest(ctx.store, chain_contexts(ctx)[0].keys, 6)
    assert head.schema_version == 2 and head.checkpoint.version == 4  # its state, written before it merged on
    report = audit_run(old.ctx)
    assert report.ok and report.versions_replayed == 6 * chains, report.problems


def test_a_checkpoint_splits_tensors_over_parts_and_names_a_damaged_one(tmp_path: Path) -> None:
    assert plan_parts([("a", 5), ("b", 0), ("c", 3)], 4) == [[("a", 0, 4)],
                                                             [("a", 4, 5), ("b", 0, 0), ("c", 0, 3)]]
    assert plan_parts([("a", 9)], 4) == [[("a", 0, 4)], [("a", 4, 8)], [("a", 8, 9)]]
    ctx = create_run(open_store(f"file://{tmp_path}"), "parts", load_config("tiny").with_overrides(OVERRIDES))
    chain = dataclasses.replace(ctx)
    params = params_at(chain, 0)[0]
    from diloco.merger.step import OuterState

    outer = OuterState({k: v * 2 for k, v in params.items()}, {k: v * 3 for k, v in params.items()})
    ref = write_checkpoint(chain, 0, params, outer, ema={"phase_s": 1.5}, manifest_checksum="",
                           created_by="t", part_bytes=10_000)
    got = read_checkpoint(chain, ref)
    assert len(got.record.parts) > 10 and got.ema == {"phase_s": 1.5}
    # the params never share a part with the outer state (a params reader reads none of it)
    kinds = [{name.startswith("params/") for name, _, _ in part.slices} for part in got.record.parts]
    assert all(len(k) == 1 for k in kinds) and kinds[0] == {True} and kinds[-1] == {False}
    assert same(got.params, params) and same(got.outer.to_tensors(), outer.to_tensors())
    assert same(read_checkpoint(chain, ref, outer=False).params, params)
    assert list(got.params) == list(params)  # the model's order, whole tensors and split ones alike
    # a part whose values do not fill the slice its name and the record give is named, not reshaped
    first = got.record.parts[0]
    short = {f"{n}[{a}:{b}]": torch.zeros(b - a - (k == 0)) for k, (n, a, b) in enumerate(first.slices)}
    data = encode_tensors(short, codec_name="fp32", kind="checkpoint", fingerprint=ctx.fingerprint)
    ctx.store.put(f"{first.key}-short", data)
    lying = first.model_copy(update={"key": f"{first.key}-short", "checksum": object_checksum(data),
                                     "bytes": len(data)})
    record = got.record.model_copy(update={"parts": [lying, *got.record.parts[1:]]}).to_bytes()
    ctx.store.put(f"{ref.key}-short", record)
    lying_ref = CheckpointRef(version=0, key=f"{ref.key}-short", checksum=object_checksum(record))
    with pytest.raises(CorruptObject, match="part 0: params/.* holds .* values of a tensor of"):
        read_checkpoint(chain, lying_ref)
    part = got.record.parts[3].key
    data = bytearray(ctx.store.get(part))
    data[-1] ^= 0xFF
    ctx.store.put(part, bytes(data))
    with pytest.raises(CorruptObject, match="part 3"):
        read_checkpoint(chain, ref)

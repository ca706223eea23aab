"""Fragment chains and the sharded merger on file://: synthetic deltas per fragment merged by the real
ShardMerger; fragmenting does not change the math (mean rule: the assembled fragments equal the whole-model
merge bit for bit; P = 1 rebuilt from the log before each merge — its checkpoint and the merges after it
replayed — commits what the merger that holds its state does, bit for bit); racing mergers on one shard
commit exactly once per fragment version; a killed shard stalls only its fragments; audit replays every
fragment chain; gc collects a fragment chain's orphans.

Run: .venv/bin/pytest tests/integration/test_fragment_merger.py -q
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from diloco.configs import ConfigError, load_config
from diloco.inspect.audit import audit_run
from diloco.inspect.gc import collect_orphans
from diloco.merger.loop import ShardMerger, run_merger
from diloco.merger.replay import recover
from diloco.run.chain_state import params_at
from diloco.run.create import create_run
from diloco.run.fragments import (
    fragment_context,
    fragment_versions,
    run_version,
    shard_merger_id,
    shard_of_id,
)
from diloco.run.objects import encode_tensors
from diloco.storage import list_versions, open_store, read_latest, read_manifest
from diloco.storage.wrapper import WrapperStore
from diloco.training.fragments import put_, take

LEARNERS = ["a-0", "a-1"]


def _cfg(count: int, shards: int = 1):
    return load_config("tiny").with_overrides({
        "fragments.count": count, "merger.shards": shards, "merger.quorum": 2, "learner.codec": "fp32",
        "outer.merge_rule": "mean", "run.num_learners": 2, "run.learner_prefix": "a"})


def _full_deltas(params: dict, rounds: int) -> list[dict[str, dict]]:
    gen = torch.Generator().manual_seed(3)
    return [{name: {k: torch.randn(v.shape, generator=gen) * 1e-2 for k, v in params.items()}
             for name in LEARNERS}
            for _ in range(rounds)]


def _publish(ctx, keys, learner: str, seq: int, tensors: dict, base: int = 0) -> None:
    meta = {"learner": learner, "seq": seq, "base_version": base,
            "tokens": 640 * (1 + LEARNERS.index(learner)),
            "steps": 10, "phase_time_s": 0.0, "train_loss": 2.0, "created_at": 0.0}
    data = encode_tensors(tensors, codec_name="fp32", kind="delta", fingerprint=ctx.fingerprint, meta=meta)
    ctx.store.put_if_absent(keys.delta(learner, seq), data)


def _publish_round(ctx, deltas: dict[str, dict], seq: int, base: int, only: list[int] | None = None) -> None:
    for index, fragment in enumerate(ctx.fragments or [None]):
        if only is not None and index not in only:
            continue
        for learner, full in deltas.items():
            part = full if fragment is None else take(full, fragment)
            _publish(ctx, ctx.keys.for_fragment(index) if fragment else ctx.keys, learner, seq, part, base)


def _params(ctx, keys, version: int) -> dict:
    """The chain's parameters at `version` (its checkpoint and the updates after it)."""
    return params_at(dataclasses.replace(ctx, keys=keys), version)[0]


def _assembled(ctx, version: int) -> dict:
    whole = {k: torch.zeros_like(v) for k, v in _params(ctx, ctx.keys, 0).items()}
    for index, fragment in enumerate(ctx.fragments):
        put_(whole, fragment, _params(ctx, ctx.keys.for_fragment(index), version))
    return whole


def test_create_records_fragments_and_commits_every_version_zero(tmp_path):
    ctx = create_run(open_store(f"file://{tmp_path}"), "r", _cfg(4, 2))
    assert len(ctx.fragments) == 4 and fragment_versions(ctx) == [0, 0, 0, 0] and run_version(ctx) == 0
    assert torch.equal(_assembled(ctx, 0)["wte.weight"], _params(ctx, ctx.keys, 0)["wte.weight"])
    assert shard_of_id(shard_merger_id(3)) == 3 and shard_of_id("merger") == 0
    assert shard_of_id("merger-2") == 0 and shard_of_id("merger-s1-2") == 1  # second processes of a shard
    with pytest.raises(ValueError, match="names no shard"):
        shard_of_id("merger-x")


def test_fragments_equal_the_whole_model_merge_bit_for_bit(tmp_path):
    """Two rounds, two learners: P = 4 over two shards vs P = 1 by today's merger, the same deltas."""
    store = open_store(f"file://{tmp_path}")
    whole, frag = create_run(store, "whole", _cfg(1)), create_run(store, "frag", _cfg(4, 2))
    rounds = _full_deltas(_params(whole, whole.keys, 0), 2)
    for seq, deltas in enumerate(rounds):
        _publish_round(whole, deltas, seq, seq)
        _publish_round(frag, deltas, seq, seq)
        assert run_merger(ShardMerger(whole), max_merges=1) == 1
        shards = [ShardMerger(frag, s) for s in range(2)]
        assert sum(len(s.poll_once()) for s in shards) == 4
        assert fragment_versions(frag) == [seq + 1] * 4
        expected, got = _params(whole, whole.keys, seq + 1), _assembled(frag, seq + 1)
        assert all(torch.equal(expected[k], got[k]) for k in expected)
    report = audit_run(frag)
    assert report.ok, report.problems
    assert (report.num_versions == 3 and report.fragment_versions == [3, 3, 3, 3]
            and report.deltas_merged == 16)


def test_a_merger_rebuilt_from_the_log_commits_what_the_one_holding_its_state_does(tmp_path):
    store = open_store(f"file://{tmp_path}")
    # no checkpoint but version 0's: all replayed
    cfg = _cfg(1).with_overrides({"state.checkpoint_every": 10})
    old, new = create_run(store, "old", cfg), create_run(store, "new", cfg)
    assert (new.fragments == []
            and open_store(f"file://{tmp_path}").exists("new/versions/" + "0" * 20 + ".json"))
    held = ShardMerger(old)
    for seq, deltas in enumerate(_full_deltas(_params(old, old.keys, 0), 3)):
        _publish_round(old, deltas, seq, seq)
        _publish_round(new, deltas, seq, seq)
        assert run_merger(held, max_merges=1) == 1
        fresh = ShardMerger(new, 0)  # a new process each round: version 0's checkpoint + every merge replayed
        assert len(fresh.poll_once()) == 1
        assert fresh.chains[0].state.last_load.replayed == seq
    for v in (1, 2, 3):
        a, b = read_manifest(store, old.keys, v), read_manifest(store, new.keys, v)
        assert a.update_checksum == b.update_checksum
        assert [d.model_dump() for d in a.decisions] == [d.model_dump() for d in b.decisions]
        pa, pb = _params(old, old.keys, v), _params(new, new.keys, v)
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    outer_a, outer_b = held.chains[0].outer.to_tensors(), fresh.chains[0].outer.to_tensors()
    assert all(torch.equal(outer_a[k], outer_b[k]) for k in outer_a)


def test_racing_mergers_on_one_shard_commit_once_per_version(tmp_path):
    ctx = create_run(open_store(f"file://{tmp_path}"), "race", _cfg(2, 1))
    _publish_round(ctx, _full_deltas(_params(ctx, ctx.keys, 0), 1)[0], 0, 0)
    rival = ShardMerger(ctx, 0, "merger-rival")
    fired = []

    def hook(stage: str) -> None:  # the rival commits fragment 0's version 1 while we are about to
        if stage == "before_manifest" and not fired:
            fired.append(stage)
            assert rival.merge_chain(0, lambda: False) is not None

    ours = ShardMerger(ctx, 0, "merger", stage_hook=hook)
    merged = ours.poll_once()
    assert [m.version for m in merged] == [1]  # fragment 0 lost the race (Conflict, reloaded); fragment 1 won
    for index, winner in enumerate(["merger-rival", "merger"]):
        keys = ctx.keys.for_fragment(index)
        assert list_versions(ctx.store, keys) == [0, 1]
        assert read_manifest(ctx.store, keys, 1).merger_id == winner
    assert ours.poll_once() == [] and ours.version(0) == 1
    assert audit_run(ctx).ok
    for merger in (ours, rival):
        merger.close()  # their checkpoints in flight land first: gc (min_age_s 0) never takes one mid-write
    gc = collect_orphans(ctx, min_age_s=0.0)  # the loser's update and window, in fragment 0's namespace only
    # (and fragment 1's checkpoint of version 1, on its shifted grid, that no manifest names yet)
    objects = sorted(k for k in gc.deleted if "/checkpoints/" not in k)
    folders = [k.rpartition("/")[0] for k in objects]
    assert folders == [f"race/fragments/0000/{d}" for d in ("global", "guard")]
    assert all(k.startswith("race/fragments/0001/checkpoints/00000000000000000001-") for k in gc.deleted
               if k not in objects)
    assert audit_run(ctx).ok


def test_a_killed_shard_stalls_only_its_fragments_and_a_restart_resumes(tmp_path):
    ctx = create_run(open_store(f"file://{tmp_path}"), "kill", _cfg(4, 2))
    deltas = _full_deltas(_params(ctx, ctx.keys, 0), 2)
    _publish_round(ctx, deltas[0], 0, 0)
    survivor = ShardMerger(ctx, 1, "merger-s1")  # shard 0 is down
    assert run_merger(survivor, target_version=1) == 2
    assert fragment_versions(ctx) == [0, 1, 0, 1] and run_version(ctx) == 0
    _publish_round(ctx, deltas[1], 1, 1, only=[1, 3])
    assert run_merger(survivor, target_version=2) == 2
    assert fragment_versions(ctx) == [0, 2, 0, 2]
    restarted = ShardMerger(ctx, 0)
    assert run_merger(restarted, target_version=1) == 2
    assert fragment_versions(ctx) == [1, 2, 1, 2] and run_version(ctx) == 1
    assert read_latest(ctx.store, ctx.keys).version == 0  # the root chain keeps only version 0
    assert audit_run(ctx).ok


def test_a_count_the_model_cannot_fill_creates_nothing(tmp_path):
    store = open_store(f"file://{tmp_path}")
    cfg = load_config("tiny").with_overrides({"fragments.count": 1000, "model.d_model": 8, "model.n_head": 1})
    with pytest.raises(ConfigError, match=r"fragments.count \(1000\)"):
        create_run(store, "toomany", cfg)
    assert store.list("toomany/") == []


def test_a_fork_of_a_fragmented_run_starts_every_chain_at_its_version_v(tmp_path):
    """Each fragment's version V (params and outer state, byte for byte) is the fork's version 0 of that
    fragment; the fork's root holds the whole model at V; it audits, and its shards merge on from there."""
    from diloco.inspect.fork import fork_run
    from diloco.run.context import RunError

    store = open_store(f"file://{tmp_path}")
    ctx = create_run(store, "parent", _cfg(4, 2))
    deltas = _full_deltas(_params(ctx, ctx.keys, 0), 3)
    for seq in range(2):
        _publish_round(ctx, deltas[seq], seq, seq)
        assert sum(len(ShardMerger(ctx, s).poll_once()) for s in range(2)) == 4
    child = fork_run(store, "parent", 1, "child")
    assert len(child.fragments) == 4 and fragment_versions(child) == [0] * 4 and run_version(child) == 0
    for index in range(4):
        theirs = read_manifest(store, ctx.keys.for_fragment(index), 1)
        ours = read_manifest(store, child.keys.for_fragment(index), 0)
        a = _params(ctx, ctx.keys.for_fragment(index), 1)
        b = _params(child, child.keys.for_fragment(index), 0)
        assert all(torch.equal(a[k], b[k]) for k in a)
        state = ShardMerger(child, index % 2).chain(index).outer.to_tensors()  # the fork's version 0: V's
        parent = recover(fragment_context(ctx, index), theirs).outer.to_tensors()  # V's, rebuilt from the log
        assert all(torch.equal(state[k], parent[k]) for k in state)
        assert ours.tokens_total == theirs.tokens_total and ours.controls[0].kind == "fork"
    whole, parent_v1 = _params(child, child.keys, 0), _assembled(ctx, 1)
    assert all(torch.equal(whole[k], parent_v1[k]) for k in parent_v1)
    assert audit_run(child).ok
    _publish_round(child, deltas[2], 0, 0)
    assert sum(len(ShardMerger(child, s).poll_once()) for s in range(2)) == 4
    report = audit_run(child)
    assert report.ok and report.fragment_versions == [2] * 4, report.problems
    with pytest.raises(RunError, match="keeps the parent's fragments"):
        fork_run(store, "parent", 1, "child-2", cfg=_cfg(2, 1))
    with pytest.raises(RunError, match="no run version 5"):
        fork_run(store, "parent", 5, "child-3")


class _Calls(WrapperStore):
    """Records the requests a poll makes: (call, key or prefix)."""

    def __init__(self, inner, log: list | None = None) -> None:
        super().__init__(inner)
        self.log = [] if log is None else log

    def _over(self, inner):
        return _Calls(inner, self.log)

    def exists(self, key: str) -> bool:
        self.log.append(("exists", key))
        return self.inner.exists(key)

    def list(self, prefix: str, after: str = "") -> list[str]:
        self.log.append(("list", prefix))
        return self.inner.list(prefix, after)

    def folders(self, prefix: str) -> list[str]:
        self.log.append(("folders", prefix))
        return self.inner.folders(prefix)


def test_a_shard_looks_at_each_chain_with_a_head_and_a_listing_a_learner(tmp_path, monkeypatch):
    """A look at a waiting chain costs a HEAD of its next version and one listing per learner's folder; the
    folder of folders is listed at a wait's start, while a member has no folder, and every FOLDERS_EVERY_S;
    the run's control ops, between a wait's start and the merge, once a second for all the shard's chains,
    not once per chain (8 chains over real links listed control/ops/ 8 times a second: docs/bench/wan.md)."""
    from diloco.merger import merger as merger_module
    from diloco.run import controls

    clock = [1_000.0]
    fake = types.SimpleNamespace(time=lambda: clock[0], monotonic=lambda: clock[0], sleep=lambda s: None)
    monkeypatch.setattr(merger_module, "time", fake)
    monkeypatch.setattr(controls, "time", fake)
    store = _Calls(open_store(f"file://{tmp_path}"))
    ctx = create_run(store, "polls", _cfg(4).with_overrides({"merger.quorum_timeout_s": 3600.0}))
    rounds = _full_deltas(_params(ctx, ctx.keys, 0), 2)
    shard = ShardMerger(ctx)
    ops, chains = ctx.keys.ops_prefix(), [ctx.keys.for_fragment(i) for i in range(4)]

    def one_pass(at: float, merges: int = 0) -> list:
        clock[0] = at
        store.log.clear()
        assert len(shard.poll_once()) == merges
        return list(store.log)

    one_pass(1_000.0)  # every chain loads; no member has a folder yet: the folders listed at every look
    assert sum(c[0] == "folders" for c in one_pass(1_000.1)) == 4
    _publish_round(ctx, rounds[0], 0, 0)
    one_pass(1_000.2, merges=4)  # version 1 of every chain; the folders listed then
    waiting = one_pass(1_000.3)  # each chain's wait starts: its ops listed fresh, its folders
    assert waiting.count(("list", ops)) == 4 and sum(c[0] == "folders" for c in waiting) == 4
    _publish_round(ctx, {"a-0": rounds[1]["a-0"]}, 1, 1)  # one of the two: no quorum, nothing merges
    look = sorted([("exists", k.manifest(2)) for k in chains] + [("list", k.deltas_prefix(n)) for k in chains
                                                                 for n in LEARNERS])
    assert sorted(one_pass(1_000.8)) == look  # a HEAD and one listing a learner, per chain
    assert sorted(one_pass(1_001.5)) == sorted([*look, ("list", ops)])  # the ops, once for the four chains
    assert sorted(one_pass(1_010.1)) == sorted([*look, ("list", ops)])  # the folders listed 9.8 s ago
    assert sorted(one_pass(1_010.3)) == sorted(look + [("folders", k.deltas_prefix()) for k in chains])
    _publish_round(ctx, {"a-1": rounds[1]["a-1"]}, 1, 1)
    one_pass(1_010.4, merges=4)
    assert fragment_versions(ctx) == [2] * 4


def test_a_shard_merges_in_the_blocks_it_keeps_and_commits_the_bits_audit_replays(tmp_path):
    """A shard's merges lay their fp64 sums and decode their deltas' first tensors in blocks the process
    keeps (MergeArenas: one pair for all its chains, the largest chain's size), left dirty by the chain
    before: no fresh block after the first merge, and audit — which replays every merge in fresh tensors —
    finds the committed bits (int4 deltas: decoded into the kept buffers)."""
    store = open_store(f"file://{tmp_path}")
    ctx = create_run(store, "kept", _cfg(3).with_overrides({"learner.codec": "int4"}))
    shard = ShardMerger(ctx)
    arenas = shard.chains[0].arenas
    assert all(m.arenas is arenas for m in shard.chains.values())
    largest = max(sum(p.numel() for p in _params(ctx, ctx.keys.for_fragment(i), 0).values())
                  for i in range(3))
    blocks = None
    for seq, deltas in enumerate(_full_deltas(_params(ctx, ctx.keys, 0), 3)):
        for index, fragment in enumerate(ctx.fragments):
            for learner, full in deltas.items():
                meta = {"learner": learner, "seq": seq, "base_version": seq, "tokens": 640, "steps": 10,
                        "phase_time_s": 0.0, "train_loss": 2.0, "created_at": 0.0}
                data = encode_tensors(take(full, fragment), codec_name="int4", kind="delta",
                                      fingerprint=ctx.fingerprint, meta=meta)
                store.put_if_absent(ctx.keys.for_fragment(index).delta(learner, seq), data)
        assert len(shard.poll_once()) == 3
        now = (arenas.sums._block.data_ptr(), arenas.buffers._block.data_ptr())
        assert blocks in (None, now)  # the first merge's blocks, kept
        blocks = now
        assert (arenas.sums.held_bytes, arenas.buffers.held_bytes) == (8 * largest, 4 * largest)
    assert fragment_versions(ctx) == [3] * 3
    report = audit_run(ctx)
    assert report.ok, report.problems
    assert report.deltas_merged == 3 * 3 * 2

"""A member's next delta slot taken by an object it did not write (issue #44: rejections caused by someone
else never count against a member): junk or a replayed copy of one of its old deltas planted at its next
seq in a live run (file:// storage, real learners and merger). The learner is not fenced: its delta
ships at the next free seq and is merged there, it is never quarantined, and audit counts the planted
object as rejected, nothing lost. A twin process publishing under the same name still fences it; a
spooled delta whose slot was taken ships on after a restart; with no free slot within MAX_MOVES the
learner stops and says why.
Run: .venv/bin/pytest tests/integration/test_taken_slots.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trust_helpers import install_all, publish_all, tiny_run

from diloco.inspect.audit import audit_run
from diloco.learner.learner import Learner
from diloco.learner.slots import MAX_MOVES, Slots
from diloco.run.context import open_run
from diloco.run.events import EventLog, read_events
from diloco.run.objects import encode_tensors
from diloco.storage import Manifest, RunKeys, open_store
from diloco.storage.codec import read_header
from diloco.trust.signing import new_key, sign


def _decided(manifest: Manifest, learner: str) -> dict[int, str]:
    return {d.seq: d.status for d in manifest.decisions if d.learner == learner}


def _round(learners, merger) -> Manifest:
    publish_all(learners)
    manifest = merger.merge_once()
    assert manifest is not None
    install_all(learners, manifest.version)
    return manifest


@pytest.mark.parametrize("signed", [False, True])
def test_a_planted_object_at_a_members_next_seq_moves_its_delta_on(tmp_path: Path, signed: bool) -> None:
    names = ("local-0", "local-1")
    keys = {name: new_key().encode() for name in names} if signed else None
    # signed: a planted object fails the signature and never counts, so even one rejection would quarantine
    extra = {"learner.sign": True, "merger.quarantine_after": 1} if signed else {}
    ctx, learners, merger = tiny_run(tmp_path, "slots", keys=keys,
                                     keyring={n: [k] for n, k in keys.items()} if keys else None, **extra)
    victim = learners[0]
    _round(learners, merger)
    old = ctx.store.get(ctx.keys.delta("local-0", 0))
    plants = {"junk": b"not a delta at all" * 10, "replayed": old}
    for what, data in plants.items():
        seq = victim.publisher.next_seq(None, victim.state.seq)  # where its next delta goes
        ctx.store.put(ctx.keys.delta("local-0", seq), data)  # a bucket writer's object at its next seq
        m = _round(learners, merger)
        assert not victim.publisher.fenced.is_set()
        assert _decided(m, "local-0") == {seq: "rejected", seq + 1: "merged"}, what
        shipped = read_header(ctx.store.get(ctx.keys.delta("local-0", seq + 1))).meta
        assert shipped["seq"] == seq + 1 and shipped["process"] == victim.publisher.slots.process
        assert victim.publisher.next_seq(None, victim.state.seq) == seq + 2  # the next one past the moved one
        assert m.guard is not None and not m.guard.quarantined and not m.guard.streaks
    m = _round(learners, merger)  # and on: the next delta at the next seq, nothing moved
    assert _decided(m, "local-0") == {victim.state.seq - 1: "merged"}
    victim.events.flush()
    taken = [e for e in read_events(ctx.store, ctx.keys) if e["kind"] == "slot_taken"]
    assert [(e["seq"], e["holder"]) for e in taken] == [(1, "planted"), (3, "planted")]
    assert "not a delta" in taken[0]["reason"] and "replayed" in taken[1]["reason"]
    for learner in learners:
        learner.close()
    ring = {n: [k] for n, k in keys.items()} if keys else None
    report = audit_run(open_run(ctx.store, ctx.run_id), keyring=ring)
    assert report.ok, report.problems
    assert (report.deltas_rejected, report.deltas_lost, report.deltas_merged) == (2, 0, 2 * 4)


def test_a_twin_process_under_the_same_name_still_fences(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path, "twin")
    _round(learners, merger)
    twin = Learner(ctx, "local-0", events=EventLog(ctx.store, ctx.keys, "local-0"))
    twin.join()  # a second process with the name: it joins at the same next seq
    assert twin.state.seq == learners[0].state.seq
    publish_all([twin])
    publish_all(learners)
    assert learners[0].publisher.fenced.is_set() and not twin.publisher.fenced.is_set()
    assert "another process publishes as this learner" in learners[0].publisher.stop_reason
    for learner in (*learners, twin):
        learner.close()


def test_a_spooled_delta_whose_slot_was_taken_ships_on_after_a_restart(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path, "spool", **{"learner.local_state_every_steps": 1})
    _round(learners, merger)
    victim = learners[0]
    victim.publisher.abandon()  # a crash before its next delta lands: the spool keeps it
    victim.run_phase()
    seq = victim.publish()
    assert seq is not None and victim.local is not None
    victim.local.flush()
    ctx.store.put(ctx.keys.delta("local-0", seq), b"planted")
    restarted = Learner(ctx, "local-0", events=EventLog(ctx.store, ctx.keys, "local-0"))
    restarted.join()
    restarted.publisher.drain()
    assert not restarted.publisher.fenced.is_set()
    moved = read_header(ctx.store.get(ctx.keys.delta("local-0", seq + 1))).meta
    assert moved["seq"] == seq + 1 and moved["process"] == victim.publisher.slots.process
    publish_all([learners[1]])
    m = merger.merge_once()
    assert m is not None and _decided(m, "local-0") == {seq: "rejected", seq + 1: "merged"}
    install_all([restarted], m.version)
    publish_all([restarted, learners[1]])  # its next delta goes past the moved one
    assert ctx.store.exists(ctx.keys.delta("local-0", seq + 2))
    for learner in (restarted, learners[1]):
        learner.close()


def test_a_learner_stops_when_no_slot_is_free(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path, "full")
    _round(learners, merger)
    victim = learners[0]
    first = victim.state.seq
    for seq in range(first, first + MAX_MOVES + 1):
        ctx.store.put(ctx.keys.delta("local-0", seq), b"junk")
    publish_all([victim])
    assert victim.publisher.fenced.is_set() and "no free slot" in victim.publisher.stop_reason
    assert not ctx.store.exists(ctx.keys.delta("local-0", first + MAX_MOVES + 1))
    for learner in learners:
        learner.close()



def test_who_holds_a_slot_is_told_from_the_holder_itself(tmp_path: Path) -> None:
    """Slots.holder on its own: with signing on, a well-formed delta of this learner and seq that claims
    another process but is not signed with the learner's key is planted (a writer without the key cannot
    fence the learner); validly signed it is a twin; an object far larger than the delta is not downloaded."""
    store, keys, key = open_store(f"file://{tmp_path}/bucket"), RunKeys("run"), new_key().encode()
    slots = Slots(store, "run", keys, "local-0", key)

    def delta(process: str, seq: int = 3) -> bytes:
        meta = {"learner": "local-0", "seq": seq, "base_version": 0, "tokens": 8, "steps": 1,
                "process": process}
        return encode_tensors({"w": torch.ones(64)}, codec_name="fp32", kind="delta", fingerprint="f",
                              meta=meta)

    ours = delta(slots.process)
    sidecar = slots.sidecar(None, 3, ours)
    assert slots.holder(None, 3, ours, sidecar).kind == "free"
    store.put(keys.delta("local-0", 3), ours)
    assert slots.holder(None, 3, ours, sidecar).kind == "ours"
    forged = delta("f0f0f0f0")
    store.put(keys.delta("local-0", 3), forged)
    held = slots.holder(None, 3, ours, sidecar)
    assert (held.kind, held.reason.split(":")[0]) == ("planted", "unsigned")
    store.put(keys.signature("local-0", 3), sign(key, "run", "local-0", 3, forged))  # the key holder's twin
    assert slots.holder(None, 3, ours, sidecar).kind == "twin"
    store.put(keys.delta("local-0", 3), delta(slots.process, seq=2))  # a copy of its own seq 2
    assert "replayed" in slots.holder(None, 3, ours, sidecar).reason
    store.put(keys.delta("local-0", 3), b"\0" * (2 * len(ours) + (1 << 20) + 1))
    assert "not read" in slots.holder(None, 3, ours, sidecar).reason
    key_at, moved, signature = slots.moved(ours, None, 4)
    assert key_at == keys.delta("local-0", 4) and read_header(moved).meta["seq"] == 4
    assert signature == (keys.signature("local-0", 4), sign(key, "run", "local-0", 4, moved))

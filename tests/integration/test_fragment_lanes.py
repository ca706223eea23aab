"""Ship-and-carry per fragment under random interleavings (property-based): phases of random length (so
fragments ship on their staggered schedule at random points between merges), shard merges, installs and
retimes of the schedule to a new H (inner.dylu).

Invariant (DESIGN §5, per fragment): shipped + carried = all local progress; with one learner, outer lr 1,
no momentum, the assembled global is exactly the start minus everything shipped; the same with every delta
encoded on the learner's encoder thread (learner.encode_in_background) and completed steps later. Also: a
learner rejoins at every fragment's newest version, with fresh seqs per fragment chain.
Run: .venv/bin/pytest tests/integration/test_fragment_lanes.py -q
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.configs import load_config
from diloco.learner.checkpoint import read_pointer
from diloco.learner.learner import Learner
from diloco.merger.loop import ShardMerger, run_merger
from diloco.run.chain_state import chain_params
from diloco.run.create import create_run
from diloco.run.fragments import fragment_context, fragment_versions, run_version
from diloco.run.objects import decode_tensors
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store, read_latest, read_manifest
from diloco.training.fragments import put_
from diloco.training.model import get_flat_params

OPS = st.lists(st.one_of(st.integers(1, 7), st.sampled_from(["merge", "install"]),
                         st.tuples(st.just("retime"), st.integers(1, 9))), min_size=3, max_size=14)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config("tiny").data)


def _cfg(count: int, codec: str, tau: int, background: bool | str = "auto"):
    return load_config("tiny").with_overrides({"learner.encode_in_background": background,
        "run.num_learners": 1, "merger.quorum": 1, "merger.grace_cap_s": 0.0, "learner.codec": codec,
        "outer.lr": 1.0, "outer.momentum": 0.0, "outer.partial_scaling": False, "inner.steps_per_phase": 4,
        "learner.probe_every_steps": 1000, "outer.max_staleness": 1000, "learner.local_state_every_steps": 0,
        "fragments.count": count, "fragments.overlap_steps": tau, "merger.shards": min(2, count)})


def _whole(template: dict, parts: list[tuple[dict, dict]]) -> dict:
    out = {k: torch.zeros_like(v) for k, v in template.items()}
    for fragment, values in parts:
        put_(out, fragment, values)
    return out


def _assembled_global(ctx) -> dict:
    parts = []
    for index, fragment in enumerate(ctx.fragments):
        chain = fragment_context(ctx, index)
        parts.append((fragment, chain_params(chain, read_latest(ctx.store, chain.keys))))
    return _whole(chain_params(ctx, read_latest(ctx.store, ctx.keys)), parts)


class Meter:
    """All local progress (the optimizer's own parameter changes) and all shipped (dequantized) deltas."""

    def __init__(self, learner: Learner) -> None:
        theta = learner.theta()
        self.total = {k: torch.zeros_like(v) for k, v in theta.items()}
        self.shipped = {k: torch.zeros_like(v) for k, v in theta.items()}
        step, feedback = learner.trainer.train_step, learner.lanes.feedback

        def counted(*batch):
            before = get_flat_params(learner.model)
            loss = step(*batch)
            for k, v in get_flat_params(learner.model).items():
                self.total[k] += v - before[k]
            return loss

        def shipped(index, dequantized):
            put_(delta := {k: torch.zeros_like(v) for k, v in self.total.items()},
                 learner.lanes.lanes[index].fragment, dequantized)
            for k in self.shipped:
                self.shipped[k] += delta[k]
            return feedback(index, dequantized)

        learner.trainer.train_step, learner.lanes.feedback = counted, shipped


def _merge_all(ctx) -> int:
    return sum(len(ShardMerger(ctx, s).poll_once()) for s in range(ctx.cfg.merger.shards))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, count=st.sampled_from([2, 3, 4]), codec=st.sampled_from(["fp32", "int8", "int4"]),
       tau=st.sampled_from([0, 1, 2]), background=st.sampled_from([False, True]))
def test_shipped_plus_carried_is_all_progress_per_fragment(corpus, ops, count, codec, tau, background):
    ctx = create_run(open_store(f"memory://lanes-{uuid.uuid4().hex[:10]}"), "lanes",
                     _cfg(count, codec, tau, background))
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    assert (learner.encoder is not None) == background
    learner.join()
    theta0 = learner.theta()
    meter = Meter(learner)
    for op in [*ops, 4, "merge", "install"]:
        if isinstance(op, int):
            learner.run_phase(num_steps=op)
            learner.drain()
        elif op == "merge":
            _merge_all(ctx)
        elif isinstance(op, tuple):  # inner.dylu: a new H from here on, the schedule's place kept
            learner.lanes.retime(max(op[1], count), learner.steps_done)
        else:
            learner.steps_done += tau  # past every overlap: an install op installs whatever is there
            learner.maybe_install()
        theta = learner.theta()
        ref = _whole(theta, [(lane.fragment, lane.ref) for lane in learner.lanes.lanes])
        for k in theta:  # shipped (as progress) + carried == all local progress
            assert torch.allclose(-meter.shipped[k] + (theta[k] - ref[k]), meter.total[k], atol=1e-5), op
    glob = _assembled_global(ctx)
    for k in theta0:  # every shipped delta merged: the global is the start plus what was shipped
        assert torch.allclose(glob[k], theta0[k] - meter.shipped[k], atol=1e-5)
        assert torch.allclose(learner.theta()[k], theta0[k] + meter.total[k], atol=1e-5)
    learner.close()


def test_staggered_schedule_and_rejoin_at_the_newest_fragments(corpus):
    ctx = create_run(open_store(f"memory://lanes-{uuid.uuid4().hex[:10]}"), "lanes", _cfg(4, "int8", 1))
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    learner.publisher.full = lambda *_: False  # a due ship waits for room (slow storage would defer it)
    learner.join()
    shipped_at: list[tuple[int, int]] = []
    ship = learner.ship
    learner.ship = lambda index, stats=None: (shipped_at.append((learner.steps_done, index))
                                              or ship(index, stats))
    learner.run_phase(num_steps=8)
    learner.drain()
    # H = 4, P = 4: one fragment per step, fragment p at step p (mod 4), fragment 0 first at step 4
    assert shipped_at == [(1, 1), (2, 2), (3, 3), (4, 0), (5, 1), (6, 2), (7, 3), (8, 0)]
    assert _merge_all(ctx) == 4 and fragment_versions(ctx) == [1, 1, 1, 1] and run_version(ctx) == 1
    learner.heartbeat(force=True, wait=True)
    learner.close()
    again = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    again.join()
    assert (again.cursor, again.trainer.step) == (learner.cursor, learner.trainer.step) == (8, 8)  # data, lr
    assert again.lanes.meta()["bases"] == [1, 1, 1, 1] and again.state.base == 1
    assert again.lanes.meta()["seqs"] == [2, 2, 2, 2]  # one past every seq published in each chain
    glob = _assembled_global(ctx)
    assert all(torch.equal(again.theta()[k], glob[k]) for k in glob)
    again.close()


def test_sync_mode_installs_each_fragment_tau_steps_after_shipping(corpus):
    """Sync: tau steps after a fragment ships the learner waits for the version deciding it; installs go by
    the compact (int8) updates and hold exactly the committed params' bits."""
    cfg = _cfg(2, "int8", 1).with_overrides({"learner.mode": "sync", "outer.update_codec": "int8"})
    ctx = create_run(open_store(f"memory://lanes-{uuid.uuid4().hex[:10]}"), "lanes", cfg)
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    learner.join()
    stop = threading.Event()
    shards = [threading.Thread(target=run_merger, args=(ShardMerger(ctx, s),),
                               kwargs={"should_stop": stop.is_set})
              for s in range(2)]
    for t in shards:
        t.start()
    try:
        learner.run_phase(num_steps=8)
    finally:
        stop.set()
        for t in shards:
            t.join(timeout=30)
    # H = 4, P = 2: fragment 0 ships at steps 4 and 8 (the last: not waited yet)
    assert learner.awaiting == {0: 1}
    for lane in learner.lanes.lanes:
        m = read_manifest(ctx.store, ctx.keys.for_fragment(lane.index), lane.base)
        assert lane.base >= 1 and m.cursors["local-0"] >= lane.seq - 1 - (lane.index in learner.awaiting)
        stored = chain_params(fragment_context(ctx, lane.index), m)
        assert all(torch.equal(lane.glob[k], stored[k]) for k in stored)
    learner.close()


def test_a_full_publisher_defers_a_lane_which_ships_everything_next_time(corpus):
    ctx = create_run(open_store(f"memory://lanes-{uuid.uuid4().hex[:10]}"), "lanes", _cfg(2, "fp32", 0))
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    learner.join()
    learner.publisher.full = lambda *_: True  # two deltas still uploading: storage slow or down
    learner.run_phase(num_steps=4)
    assert ([lane.seq for lane in learner.lanes.lanes] == [0, 0]
            and [lane.steps for lane in learner.lanes.lanes] == [4, 4])
    learner.publisher.full = lambda *_: False
    learner.run_phase(num_steps=4)  # H = 4: fragment 1 due at step 6, fragment 0 at step 8
    learner.drain()
    for index, steps in ((0, 8), (1, 6)):
        data = ctx.store.get(ctx.keys.for_fragment(index).delta("local-0", 0))
        assert decode_tensors(data)[0].meta["steps"] == steps  # nothing lost: the deferred steps ship with it
    learner.close()


def _train_ship_merge_install(corpus, background: bool) -> tuple[dict, dict, list]:
    """One learner, 4 fragments, tau 0 (a lane may install at the step it ships, its encode still running):
    phases with merges between them, installs within them; (every delta's tensors by key, the learner's final
    theta, the publish events in order)."""
    cfg = _cfg(4, "int4", 0, background).with_overrides({"learner.probe_every_steps": 1})
    ctx = create_run(open_store(f"memory://lanes-{uuid.uuid4().hex[:10]}"), "lanes", cfg)
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    # no deferral (it depends on upload timing): every due ship ships
    learner.publisher.full = lambda *_: False
    learner.join()
    for steps in (5, 3, 6, 2, 7):
        learner.run_phase(num_steps=steps)  # installs (probing every step) within phases, encodes in flight
        learner.drain()  # every delta taken is in the bucket before the merge, in both modes
        _merge_all(ctx)
    learner.drain()
    deltas = {key: decode_tensors(ctx.store.get(key))[1] for index in range(4)
              for key in ctx.store.list(ctx.keys.for_fragment(index).deltas_prefix())}
    events = [(e["fragment"], e["seq"], e["steps"], e["version"])
              for e in learner.events._buf if e["kind"] == "publish"]
    theta = learner.theta()
    learner.close()
    return deltas, theta, events


def test_encoding_in_the_background_ships_the_same_bits(corpus):
    """learner.encode_in_background (a GPU learner's default) only moves the encode off the training thread:
    the same deltas, bit for bit, the same installs and the same final parameters as encoding inline."""
    inline, theta_inline, events_inline = _train_ship_merge_install(corpus, False)
    background, theta_background, events_background = _train_ship_merge_install(corpus, True)
    assert len(inline) == len(events_inline) >= 20 and list(inline) == list(background)
    assert events_inline == events_background
    assert all(torch.equal(inline[key][k], background[key][k]) for key in inline for k in inline[key])
    assert all(torch.equal(theta_inline[k], theta_background[k]) for k in theta_inline)


def _slow_encodes(monkeypatch, seconds: float, fail_seq: int | None = None,
                  fragment: int | None = None) -> None:
    """Fragment deltas (every fragment's, or `fragment`'s) take `seconds` longer to encode (a 125 MB fragment
    on one core); the one of `fail_seq` (`fragment`'s, when given) fails as the codec does on a non-finite
    value."""
    from diloco.learner import ship as shipping
    from diloco.storage.codec import CodecError

    encode = shipping.encode_shipped

    def slow(delta, **kwargs):
        ours = fragment is None or kwargs["meta"]["fragment"] == fragment
        if ours:
            time.sleep(seconds)
        if ours and kwargs["meta"]["seq"] == fail_seq:
            raise CodecError("int4 cannot encode a non-finite value")
        return encode(delta, **kwargs)

    monkeypatch.setattr(shipping, "encode_shipped", slow)


def test_a_lane_ships_again_only_after_its_last_encode_completed(corpus, monkeypatch):
    """H = 2, P = 2: lane 0 ships every 2 steps, sooner than its encode ends; r_p - theta_p is read only once
    the last delta's error feedback is in r_p."""
    ctx = create_run(open_store(f"memory://lanes-{uuid.uuid4().hex[:10]}"), "lanes",
                     _cfg(2, "int8", 0, True).with_overrides({"inner.steps_per_phase": 2}))
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    learner.join()
    _slow_encodes(monkeypatch, 0.2)
    learner.publisher.full = lambda *_: False  # no deferral: every due ship happens, encodes or not
    delta, reads = learner.lanes.delta, []

    def checked(index, theta):
        reads.append(any(job.index == index for job in learner.shipping))
        return delta(index, theta)

    learner.lanes.delta = checked
    learner.run_phase(num_steps=8)
    learner.drain()
    assert len(reads) == 8 and not any(reads)  # no lane read with its own encode still pending
    assert [lane.seq for lane in learner.lanes.lanes] == [4, 4]
    learner.close()


def test_an_outage_defers_ships_while_deltas_are_still_encoding(corpus, monkeypatch):
    """Storage down and encodes slower than a step: the deltas being encoded count against the publisher's
    room, so the learner defers the next ships and trains on instead of blocking on a full queue."""
    from diloco.chaos.control import StorageWindow
    from diloco.chaos.faulty_store import FaultyStore

    ctx = create_run(open_store(f"memory://lanes-{uuid.uuid4().hex[:10]}"), "lanes", _cfg(2, "fp32", 0, True))
    faulty = FaultyStore(ctx.store, [])
    learner = Learner(dataclasses.replace(ctx, store=faulty), "local-0", make_spec(ctx.cfg, corpus))
    learner.join()
    _slow_encodes(monkeypatch, 1.0)  # far longer than the steps between two ships, even on a loaded machine
    faulty.windows[:] = [StorageWindow(t0=time.time(), outage=True)]
    done = threading.Event()
    trainer = threading.Thread(target=lambda: [learner.run_phase(num_steps=4) for _ in range(3)]
                               and done.set(), daemon=True)
    trainer.start()
    trainer.join(timeout=60)
    training_went_on = done.is_set()
    faulty.windows.clear()  # let a stuck learner go before asserting
    trainer.join(timeout=60)
    assert training_went_on, "the learner blocked on the full publisher"
    assert learner.trainer.step == 12 and sum(lane.seq for lane in learner.lanes.lanes) == 2
    learner.drain()
    for index in range(2):  # what was deferred ships with the lane's next delta: nothing lost
        learner.ship(index)
    learner.drain()
    steps = {i: [decode_tensors(ctx.store.get(k))[0].meta["steps"]
                 for k in sorted(ctx.store.list(ctx.keys.for_fragment(i).deltas_prefix()))] for i in range(2)}
    assert sum(steps[0]) == sum(steps[1]) == 12, steps
    learner.close()


def test_a_failed_background_encode_ends_the_learner(corpus, monkeypatch):
    ctx = create_run(open_store(f"memory://lanes-{uuid.uuid4().hex[:10]}"), "lanes", _cfg(2, "int4", 0, True))
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    learner.publisher.full = lambda *_: False  # every due ship ships: seq 1 is taken in every lane
    learner.join()
    # one delta fails: fragment 0's seq 1 would fail too, and still be queued when fragment 1's is raised if
    # the encoder thread lags a step behind (a loaded machine), so close() would raise it
    _slow_encodes(monkeypatch, 0.0, fail_seq=1, fragment=1)
    with pytest.raises(RuntimeError, match="encoding fragment 1's delta seq 1 failed: CodecError"):
        learner.run_phase(num_steps=12)
        learner.drain()
    learner.close()  # the failed delta is dropped: the others complete, and close does not raise it again


def test_the_cycles_checkpoint_goes_alone_when_fragment_zeros_delta_waits(corpus):
    """learner.checkpoint with fragments: written after fragment 0's delta, once a cycle; when that delta
    waits (the publisher full), the checkpoint goes alone, and a learner on a new host resumes from it."""
    cfg = _cfg(2, "fp32", 0).with_overrides({"learner.checkpoint": True, "learner.checkpoint_every": 1})
    ctx = create_run(open_store(f"memory://lanes-{uuid.uuid4().hex[:10]}"), "lanes", cfg)
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    learner.join()
    learner.publisher.full = lambda *_: False
    learner.run_phase(num_steps=4)  # fragment 1 at step 2, fragment 0 (and the checkpoint) at step 4
    learner.drain()
    pointer = read_pointer(ctx.store, ctx.keys, "local-0")
    assert (pointer.step, pointer.seq, pointer.moments.seq) == (4, 0, 0)
    learner.publisher.full = lambda *_: True  # storage slow: every due delta waits
    learner.run_phase(num_steps=4)
    learner.drain()
    pointer = read_pointer(ctx.store, ctx.keys, "local-0")
    assert (pointer.step, pointer.cursor) == (8, 8) and pointer.moments.step == 8
    assert [lane.seq for lane in learner.lanes.lanes] == [1, 1]
    learner.close()
    again = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    again.join()
    assert again.trainer.step == 8 and again.cursor == 8
    again.close()

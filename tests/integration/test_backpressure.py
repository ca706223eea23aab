"""Back-pressure (learner.max_unmerged): a learner with that many of its own deltas shipped and not decided by
the version it holds trains on and ships their progress with a later delta, so a merger that cannot keep up
gets fewer, larger deltas, never a backlog that grows without bound. Nothing is lost: the deferred steps ship
with the next delta, and the run audits clean. Whole-model learners and fragment lanes (each lane on its own
chain). Run: .venv/bin/pytest tests/integration/test_backpressure.py -q
"""

from __future__ import annotations

import uuid

import pytest

from diloco.configs import load_config
from diloco.inspect.audit import audit_run
from diloco.learner.learner import Learner
from diloco.merger.loop import ShardMerger
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.run.events import EventLog, read_events
from diloco.run.fragments import manifests
from diloco.run.objects import decode_tensors
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store
from diloco.storage.records import LearnerStatus, read_record

OVERRIDES = {"run.num_learners": 1, "merger.quorum": 1, "merger.grace_cap_s": 0.0,
             "learner.local_state_every_steps": 0, "learner.probe_every_steps": 1000}


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config("tiny").data)


def _run(tmp_path, **overrides):
    cfg = load_config("tiny").with_overrides({**OVERRIDES, **overrides})
    return create_run(open_store(f"file://{tmp_path}/bucket"), f"bp-{uuid.uuid4().hex[:8]}", cfg)


def _reported(learner) -> int | None:
    """The unmerged count the learner's status.json says (what `diloco status` shows)."""
    learner.heartbeat(force=True, wait=True)
    return read_record(learner.ctx.store, learner.ctx.keys.status(learner.name), LearnerStatus).unmerged


def _deferred(ctx) -> list[dict]:
    return [e for e in read_events(ctx.store, ctx.keys) if e["kind"] == "publish_deferred"]


def test_a_learner_with_max_unmerged_deltas_trains_on_and_ships_them_later(tmp_path, corpus):
    ctx = _run(tmp_path, **{"learner.max_unmerged": 2})
    worker = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus),
                     events=EventLog(ctx.store, ctx.keys, "local-0"))
    worker.join()
    h = ctx.cfg.inner.steps_per_phase
    seqs = []
    for _ in range(4):  # no merge meanwhile: the merger is behind
        seqs.append(worker.publish(worker.run_phase()))
        assert worker.publisher.drain(timeout_s=60)  # landed: what holds the next ones back is not the upload
    assert seqs == [0, 1, None, None] and worker.state.steps_since_publish == 2 * h
    assert _reported(worker) == 2
    merger = Merger(ctx)
    merger.load()
    assert merger.merge_once() is not None  # both pending deltas, one version
    assert worker.maybe_install() == 1 and worker.state.merged == 1 and worker.state.unmerged() == 0
    assert _reported(worker) == 0
    # the three phases since seq 1
    assert worker.publish(worker.run_phase()) == 2 and worker.state.unmerged() == 1
    worker.publisher.drain()
    assert [(d.seq, d.steps) for d in merger.merge_once().merged()] == [(2, 3 * h)]
    worker.close()
    assert [(m.version, [d.seq for d in m.merged()])
            for m in manifests(ctx)] == [(0, []), (1, [0, 1]), (2, [2])]
    deferred = _deferred(ctx)
    assert [(e["reason"], e["unmerged"], e["steps"])
            for e in deferred] == [("unmerged", 2, h), ("unmerged", 2, 2 * h)]
    assert audit_run(ctx).ok


def test_zero_max_unmerged_never_holds_a_delta_back(tmp_path, corpus):
    ctx = _run(tmp_path, **{"learner.max_unmerged": 0})
    worker = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    worker.join()
    seqs = []
    for _ in range(6):
        seqs.append(worker.publish(worker.run_phase()))
        assert worker.publisher.drain(timeout_s=60)
    worker.close()
    assert seqs == list(range(6)) and worker.state.unmerged() == 6 and not _deferred(ctx)


def test_a_rejoin_knows_what_of_its_own_was_merged(tmp_path, corpus):
    ctx = _run(tmp_path, **{"learner.max_unmerged": 2})
    first = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    first.join()
    for _ in range(2):
        first.publish(first.run_phase())
    first.close()
    merger = Merger(ctx)
    merger.load()
    merger.merge_once()
    again = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))  # a restarted process: from the bucket
    again.join()
    assert (again.state.seq, again.state.merged, again.state.unmerged()) == (2, 1, 0)
    assert again.publish(again.run_phase()) == 2
    again.close()


def test_a_resume_from_local_state_keeps_holding_back(tmp_path, corpus, monkeypatch):
    """The local state keeps the learner's cursor: a process restarted on its host while the merger is down
    holds back at once, instead of shipping a delta every phase until its first install (seen: 3,386 deltas
    each in two minutes, with the merger unable to load its version)."""
    monkeypatch.setenv("DILOCO_LOCAL_DIR", str(tmp_path / "local"))
    ctx = _run(tmp_path, **{"learner.max_unmerged": 2, "learner.local_state_every_steps": 5})
    first = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))
    first.join()
    assert [first.publish(first.run_phase()) for _ in range(2)] == [0, 1]
    first.close()
    again = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus))  # the same host: from its local state
    again.join()
    assert (again.state.seq, again.state.merged, again.state.unmerged()) == (2, -1, 2)
    assert again.publish(again.run_phase()) is None and _reported(again) == 2
    again.close()


def test_a_fragment_lane_with_max_unmerged_deltas_ships_everything_later(tmp_path, corpus):
    ctx = _run(tmp_path, **{"learner.max_unmerged": 1, "fragments.count": 2, "fragments.overlap_steps": 0,
                            "inner.steps_per_phase": 4, "learner.codec": "fp32", "learner.prefetch": False})
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus),
                      events=EventLog(ctx.store, ctx.keys, "local-0"))
    learner.join()
    learner.publisher.full = lambda *_: False  # uploads never hold a ship back here: only the unmerged
    learner.run_phase(num_steps=4)  # H = 4: fragment 0 ships at step 4, fragment 1 at step 2
    learner.drain()
    assert [lane.seq for lane in learner.lanes.lanes] == [1, 1]
    learner.run_phase(num_steps=4)  # both lanes due again, each with one delta not merged: deferred
    assert ([lane.seq for lane in learner.lanes.lanes] == [1, 1]
            and [lane.steps for lane in learner.lanes.lanes] == [4, 6])
    assert _reported(learner) == 2  # one delta of each lane: summed over the chains
    for shard in range(ctx.cfg.merger.shards):
        ShardMerger(ctx, shard).poll_once()
    assert (sorted(learner.maybe_install()) == [0, 1]
            and [lane.unmerged() for lane in learner.lanes.lanes] == [0, 0])
    assert _reported(learner) == 0
    learner.run_phase(num_steps=4)
    learner.drain()
    learner.close()
    for index, steps in ((0, 8), (1, 8)):
        data = ctx.store.get(ctx.keys.for_fragment(index).delta("local-0", 1))
        assert decode_tensors(data)[0].meta["steps"] == steps  # nothing lost: the deferred steps ship with it
    assert {(e["fragment"], e["reason"]) for e in _deferred(ctx)} == {(0, "unmerged"), (1, "unmerged")}

"""DyLU in the engine (inner.dylu): a learner reads its live peers' compute speeds from their status.json (a
finished, silent or hostile peer is skipped) and runs H_w = floor(v_w / v_max * H) steps a phase; a fragmented
learner's lanes are retimed to H_w, so each fragment ships once in every H_w steps. The slow learner is a
chaos slowdown (its steps take 6x longer: still well under half the speed with the other on a busy core), the
fast one runs as is.
Run: .venv/bin/pytest tests/integration/test_dylu.py -q
"""

from __future__ import annotations

import time
import uuid

import pytest

from diloco.configs import load_config
from diloco.learner.learner import Learner
from diloco.learner.loop import learner_step
from diloco.learner.pace import Pace, phase_steps
from diloco.run.create import create_run
from diloco.run.events import EventLog, read_events
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store
from diloco.storage.records import LearnerStatus, read_record, write_record

H = 12


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config("tiny").data)


def _status(name: str, speed: float, state: str = "training", age_s: float = 0.0) -> LearnerStatus:
    return LearnerStatus(learner=name, state=state, t=time.time() - age_s, pid=1, seq=0, base_version=0,
                         step=5, cursor=5, loss=1.0, bytes_published=0, compute_steps_per_s=speed)


def test_the_fastest_live_peer_is_read_from_the_statuses(store_url):
    ctx = create_run(open_store(store_url), "pace",
                     load_config("tiny").with_overrides({"run.num_learners": 6}))
    me, live, slower, done, silent, hostile = ctx.learners
    for name, status in ((live, _status(live, 3.0)), (slower, _status(slower, 1.5)),
                         (done, _status(done, 9.0, state="finished")),
                         (silent, _status(silent, 8.0, age_s=600))):
        write_record(ctx.store, ctx.keys.status(name), status)
    ctx.store.put(ctx.keys.status(hostile),
                  _status(hostile, 1.0).to_bytes().replace(b'"compute_steps_per_s":1.0',
                                                           b'"compute_steps_per_s":-7e9'))
    pace = Pace(ctx.store, ctx.keys, me, ctx.learners, H, timeout_s=60.0)
    pace.refresh()
    assert pace.peers_steps_per_s == 3.0  # not the finished one, not the silent one, not the hostile one
    pace.own_steps_per_s = 1.0
    assert pace.fastest() == 3.0 and pace.steps() == phase_steps(H, 1.0, 3.0) == 4
    ctx.store.delete(ctx.keys.status(live))  # gone: the next read forgets it
    pace.refresh()
    assert pace.peers_steps_per_s == 1.5 and pace.steps() == 8
    assert not pace.observe(10, 10.0)  # read just now: the next read waits REFRESH_S
    alone = Pace(ctx.store, ctx.keys, me, [me, "local-99"], H)
    alone.refresh()  # no peer has reported a speed yet: read again after the next phase
    assert alone.peers_steps_per_s is None and alone.observe(10, 10.0) and alone.steps() == H


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_slow_learner_runs_its_share_of_h_and_the_fast_one_all_of_it(corpus, fragments):
    cfg = load_config("tiny").with_overrides({
        "run.num_learners": 2, "inner.steps_per_phase": H, "inner.dylu": True, "learner.probe_every_steps": 4,
        "learner.local_state_every_steps": 0, "fragments.count": fragments, "fragments.overlap_steps": 1,
        "merger.shards": 1})
    ctx = create_run(open_store(f"memory://dylu-{uuid.uuid4().hex[:10]}"), "dylu", cfg)
    fast, slow = (Learner(ctx, name, make_spec(ctx.cfg, corpus), events=EventLog(ctx.store, ctx.keys, name),
                          slowdown=6.0 if k else None) for k, name in enumerate(ctx.learners))
    for learner in (fast, slow):
        learner.join()
        learner_step(learner, lambda: False)  # a phase of H: no speeds known yet
        learner.courier.drain()  # its status (with its speed) written, its peer's read
    for learner in (fast, slow):
        learner.pace.refresh()  # the peer's status of the phase just run
        status = read_record(ctx.store, ctx.keys.status(learner.name), LearnerStatus)
        assert status.compute_steps_per_s == pytest.approx(learner.pace.own_steps_per_s)
    # 6x the compute time, whatever the noise
    assert slow.pace.own_steps_per_s < 0.5 * fast.pace.own_steps_per_s
    expected = phase_steps(H, slow.pace.own_steps_per_s, fast.pace.own_steps_per_s, slow.pace.min_steps)
    assert slow.pace.min_steps <= expected <= H // 2
    assert learner_step(fast, lambda: False).steps == H
    assert learner_step(slow, lambda: False).steps == expected
    if fragments > 1:  # the lanes retimed: in the next two cycles of H_w each fragment ships twice
        assert slow.lanes.steps_per_phase == expected
        before = [lane.seq for lane in slow.lanes.lanes]
        slow.publisher.full = lambda *_: False  # a due ship waits for room (slow storage would defer it)
        for _ in range(2):
            slow.run_phase(expected)
        slow.drain()
        assert [lane.seq - b for lane, b in zip(slow.lanes.lanes, before, strict=True)] == [2] * fragments
    for learner in (fast, slow):
        learner.close()
        learner.events.flush()
    paced = [e for e in read_events(ctx.store, ctx.keys) if e["kind"] == "pace"]
    assert [(e["learner"], e["steps_per_phase"]) for e in paced] == [(slow.name, expected)]

"""Local learner state: a learner process restarted on the same host resumes from its own disk —
mid-phase, without the bucket, with the deltas an outage kept from landing — and never trusts a
state that the bucket has moved past, that belongs to another run, or that is unreadable. A save is written
on the training thread (after the spool writes before it), names r's and G's spill files instead of copying
them, and periodic saves take at most a tenth of the training thread.
Run: .venv/bin/pytest tests/integration/test_local_state.py -q
"""

from __future__ import annotations

import dataclasses
import shutil
import time

import pytest
import torch

from diloco.chaos.control import StorageWindow
from diloco.chaos.faulty_store import FaultyStore
from diloco.configs import load_config
from diloco.inspect.audit import audit_run
from diloco.learner.learner import Learner
from diloco.learner.resume import resume
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.run.events import EventLog, read_events
from diloco.run.fragments import manifests
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store

OVERRIDES = {"run.num_learners": 1, "merger.quorum": 1, "merger.grace_cap_s": 0.0,
             "learner.local_state_every_steps": 5}  # tiny: H = 10, so one save mid-phase


@pytest.fixture
def corpus():
    return load_corpus(load_config("tiny").data)


def new_run(tmp_path, run_id="local", **overrides):
    cfg = load_config("tiny").with_overrides({**OVERRIDES, **overrides})
    return create_run(open_store(f"file://{tmp_path}/bucket"), run_id, cfg)


def learner(ctx, corpus) -> Learner:
    return Learner(ctx, "local-0", make_spec(ctx.cfg, corpus),
                   events=EventLog(ctx.store, ctx.keys, "local-0"))


def ship(worker: Learner, merger: Merger, phases: int) -> None:
    for _ in range(phases):
        worker.run_phase()
        worker.publish()
        worker.publisher.drain()
        merger.merge_once()


def started(tmp_path, corpus, phases: int) -> tuple:
    """A new run, its merger, and learner local-0 after `phases` shipped and merged phases."""
    ctx = new_run(tmp_path)
    merger = Merger(ctx)
    merger.load()
    first = learner(ctx, corpus)
    first.join()
    ship(first, merger, phases)
    return ctx, merger, first


def joins(ctx, worker: Learner | None = None) -> list[dict]:
    if worker is not None:
        worker.events.flush()
    return [e for e in read_events(ctx.store, ctx.keys)
            if e["kind"] == "join" and e.get("learner") == "local-0"]


def test_restart_resumes_mid_phase_from_local_state(tmp_path, corpus):
    ctx, merger, first = started(tmp_path, corpus, 2)
    first.local.flush()  # the last publish's state is written: the periodic save is not skipped for it
    first.run_phase()  # saved after 5 of its 10 steps; the last 5 die with the process
    first.local.flush()  # the save is written off the training thread: let it land before the "crash"
    saved = first.local.load()
    first.publisher.abandon()
    first.events.flush()
    assert saved.meta["next_seq"] == 2 and saved.meta["steps_since_publish"] == 5

    second = learner(ctx, corpus)
    assert second.join() == saved.meta["base_version"]
    assert second.state.seq == 2 and second.state.steps_since_publish == 5
    assert second.cursor == saved.meta["cursor"] and second.trainer.step == saved.meta["step"]
    theta = second.theta()
    assert all(torch.equal(theta[k], saved.parts["theta"][k]) for k in theta)
    assert joins(ctx, second)[-1]["local"] is True
    ship(second, merger, 1)  # the resumed half phase ships with the next one: 15 steps in delta 2
    second.close()
    last = manifests(ctx)[-1]
    assert [(d.seq, d.steps) for d in last.merged()] == [(2, 15)]
    assert audit_run(ctx).ok


# run: the join cannot read the run's clock either, and goes on
@pytest.mark.parametrize("clock", ["own", "run"])
def test_delta_kept_from_an_outage_lands_after_the_restart(tmp_path, corpus, clock):
    ctx = new_run(tmp_path, **{"inner.schedule_clock": clock})
    faulty = FaultyStore(ctx.store, [])
    # the learner's view of the bucket; the merger's is real
    learner_ctx = dataclasses.replace(ctx, store=faulty)
    merger = Merger(ctx)
    merger.load()
    first = learner(learner_ctx, corpus)
    first.join()
    ship(first, merger, 1)
    faulty.windows[:] = [StorageWindow(t0=time.time(), outage=True)]  # in place: the learner's views share it
    first.run_phase()
    first.publish()  # seq 1 cannot land: kept in the spool
    time.sleep(0.3)
    first.publisher.abandon()  # the crash, during the outage
    first.local.flush()
    spooled = first.local.spooled()
    assert [seq for seq, _ in spooled] == [1]

    # The resume's check of the bucket gives up after one quick retry: two attempts, not the store's whole
    # retry budget (six attempts, ~1.2 s of back-off that every restart in an outage waited before training).
    # Its own view of the outage, so that nothing else counts: the resume alone, nothing set or queued.
    alone = FaultyStore(ctx.store, [StorageWindow(t0=0.0, outage=True)])
    resumed = resume(dataclasses.replace(ctx, store=alone), "local-0", local=first.local, events=first.events,
                     set_theta=lambda _: None, import_optimizer=lambda *_: 0, requeue=lambda *_: None)
    assert resumed.extra["local"] and resumed.state.seq == 2 and alone.injected == 2

    second = learner(learner_ctx, corpus)
    second.join()  # the bucket is unreachable: resumes unchecked from the local state
    assert second.state.seq == 2 and second.trainer.clock_offset == 0
    faulty.windows.clear()  # storage is back
    assert second.publisher.drain(timeout_s=60)
    # the very bytes computed before the crash
    assert ctx.store.get(ctx.keys.delta("local-0", 1)) == spooled[0][1]
    second.local.flush()
    assert second.local.spooled() == []
    merger.merge_once()
    ship(second, merger, 1)
    second.close()
    merged = [(d.learner, d.seq) for m in manifests(ctx) for d in m.merged()]
    assert merged == [("local-0", 0), ("local-0", 1), ("local-0", 2)]
    assert any(e.get("local") and e.get("requeued") == [1] for e in joins(ctx))
    assert audit_run(ctx).ok


def test_state_the_bucket_moved_past_is_dropped(tmp_path, corpus, monkeypatch):
    ctx, merger, first = started(tmp_path, corpus, 2)  # local state: next seq 2
    first.close()
    home = first.local.dir
    monkeypatch.setenv("DILOCO_LOCAL_DIR", str(tmp_path / "another-host"))
    elsewhere = learner(ctx, corpus)  # the same learner restarted on another host: no local state there
    elsewhere.join()
    assert elsewhere.state.seq == 2
    ship(elsewhere, merger, 2)  # seqs 2 and 3
    elsewhere.close()
    monkeypatch.setenv("DILOCO_LOCAL_DIR", str(home.parents[2]))
    back = learner(ctx, corpus)
    assert back.local.dir == home and back.local.load() is not None
    back.join()
    assert back.state.seq == 4 and not joins(ctx, back)[-1].get("local")
    assert back.local.load() is None  # cleared
    back.close()


def test_state_of_another_run_or_unreadable_is_ignored(tmp_path, corpus):
    _, _, first = started(tmp_path, corpus, 1)
    first.close()
    state_file = first.local.dir / "state.bin"
    assert state_file.exists()

    shutil.rmtree(tmp_path / "bucket")  # a new run with the same id and storage
    ctx2 = new_run(tmp_path)
    fresh = learner(ctx2, corpus)
    assert fresh.local.dir == first.local.dir and fresh.local.load() is None
    fresh.join()
    assert fresh.state.seq == 0 and fresh.state.base == 0 and not joins(ctx2, fresh)[-1].get("local")
    fresh.close()

    state_file.write_bytes(b"\x00garbage" * 100)  # torn or hostile: never trusted
    again = learner(ctx2, corpus)
    assert again.local.load() is None
    again.join()
    assert not joins(ctx2, again)[-1].get("local")
    again.close()


def test_an_outage_defers_shipping_not_training(tmp_path, corpus):
    ctx = new_run(tmp_path)
    faulty = FaultyStore(ctx.store, [])
    worker = learner(dataclasses.replace(ctx, store=faulty), corpus)
    worker.join()
    merger = Merger(ctx)
    merger.load()
    h = ctx.cfg.inner.steps_per_phase
    faulty.windows[:] = [StorageWindow(t0=time.time(), outage=True)]
    seqs = [worker.publish(worker.run_phase()) for _ in range(4)]
    assert seqs == [0, 1, None, None]  # two deltas wait for the bucket; then training goes on unshipped
    assert worker.state.steps_since_publish == 2 * h
    faulty.windows.clear()
    assert worker.publisher.drain(timeout_s=60)
    worker.run_phase()
    assert worker.publish() == 2  # one delta carries the three phases since seq 1
    worker.publisher.drain()
    merger.merge_once()
    worker.close()
    assert [(d.seq, d.steps) for m in manifests(ctx) for d in m.merged()] == [(0, h), (1, h), (2, 3 * h)]
    deferred = [e for e in read_events(ctx.store, ctx.keys) if e["kind"] == "publish_deferred"]
    assert [e["steps"] for e in deferred] == [h, 2 * h]
    assert audit_run(ctx).ok


def test_a_save_is_written_when_it_returns_after_the_spool_writes_and_names_r_and_g(tmp_path, corpus):
    """A save runs on the calling thread, after the spool writes queued before it: when it returns the state
    is on disk with the delta's spool file; r and G are named by their spill files, not copied into it."""
    ctx = new_run(tmp_path)
    worker = learner(ctx, corpus)
    worker.join()
    local = worker.local
    local.spool(7, b"delta seven")
    worker.save_local()  # no flush: written by now
    assert local.spooled() == [(7, b"delta seven")] and not local.writing()
    saved = local.load()
    files = saved.meta["files"]
    assert files["ref"] == files["glob"] == [worker.state.glob.path.name]  # r is G right after a join
    assert (local.dir / files["glob"][0]).exists()
    assert set(saved.parts["glob"]) == set(worker.theta())
    theta_bytes = sum(4 * v.numel() for v in worker.theta().values())
    assert (local.dir / "state.bin").stat().st_size < 4 * theta_bytes  # theta and the optimizer, not r or G
    worker.close()
    assert (local.dir / files["glob"][0]).exists()  # the state on disk still names it


def test_periodic_saves_take_at_most_a_tenth_of_the_training_thread(tmp_path, corpus, monkeypatch):
    ctx = new_run(tmp_path, **{"learner.local_state_every_steps": 1})
    worker = learner(ctx, corpus)
    worker.join()
    saves = []
    save_local = worker.save_local
    monkeypatch.setattr(worker, "save_local", lambda *a: saves.append(worker.trainer.step) or save_local(*a))
    worker.save_local()
    worker.local.last_save_s = 3600.0  # the last save (just now) took an hour: the next may wait nine
    saves.clear()
    stats = worker.run_phase(num_steps=4)
    assert saves == [] and stats.save_s == 0
    worker.local.last_save_s = 0.5  # under a second: never skipped
    stats = worker.run_phase(num_steps=3)
    assert saves == [5, 6] and stats.save_s > 0  # the phase's last step: publish() saves it
    worker.close()


def test_a_landed_deltas_spool_file_stays_until_a_state_on_disk_counts_it(tmp_path, corpus):
    """A delta that landed before any state on disk counts it as shipped keeps its spool file (a crash then,
    bucket away, must not lose it); the state that counts it removes it."""
    ctx = new_run(tmp_path)
    worker = learner(ctx, corpus)
    worker.join()
    local = worker.local
    parts = {"theta": worker.theta(), "ref": worker.state.ref, "glob": worker.state.glob, "opt": {}}
    meta = {**worker.state.meta(), "learner": "local-0", "step": 0, "cursor": 0, "optimizer": {}}
    spool = local.dir / f"delta-{7:012d}.bin"
    local.save(parts, {**meta, "next_seq": 7})
    local.spool(7, b"delta seven")
    local.unspool(7)  # delta 7 landed
    local.flush()
    assert local.load().meta["next_seq"] == 7 and spool.exists()  # the state on disk does not count it yet
    local.save(parts, {**meta, "next_seq": 8})
    assert local.load().meta["next_seq"] == 8 and not spool.exists()
    worker.close()


def test_a_fragmented_learner_resumes_from_its_local_state_with_each_chains_spool(tmp_path, corpus):
    """Fragments (P = 2): the state holds every lane; a delta of each chain kept from landing by an outage is
    uploaded from its chain's spool after the restart, the very bytes, and the run audits clean."""
    from diloco.merger.loop import ShardMerger

    ctx = new_run(tmp_path, **{"fragments.count": 2, "fragments.overlap_steps": 0, "inner.steps_per_phase": 4,
                               "learner.local_state_every_steps": 2})
    faulty = FaultyStore(ctx.store, [])
    learner_ctx = dataclasses.replace(ctx, store=faulty)
    first = learner(learner_ctx, corpus)
    first.join()
    faulty.windows[:] = [StorageWindow(t0=time.time(), outage=True)]
    first.run_phase()  # H = 4: fragment 1 ships at step 2, fragment 0 at step 4; neither can land
    first.publish()
    time.sleep(0.3)
    first.publisher.abandon()  # the crash, during the outage
    first.local.flush()
    spooled = {p: first.local.spooled(p) for p in (0, 1)}
    assert {p: [seq for seq, _ in kept] for p, kept in spooled.items()} == {0: [0], 1: [0]}
    assert first.local.spooled() == []  # the root chain has none

    second = learner(learner_ctx, corpus)
    second.join()  # the bucket is unreachable: resumes unchecked from the local state
    assert second.lanes.meta()["seqs"] == [1, 1] and second.cursor == 4 and second.trainer.step == 4
    faulty.windows.clear()  # storage is back
    assert second.publisher.drain(timeout_s=60)
    for p in (0, 1):
        assert ctx.store.get(ctx.keys.for_fragment(p).delta("local-0", 0)) == spooled[p][0][1]
    second.local.flush()
    assert second.local.spooled(0) == second.local.spooled(1) == []
    assert any(e.get("local") and e.get("requeued") == [[0, 0], [1, 0]] for e in joins(ctx, second))
    assert sum(len(ShardMerger(ctx, 0).poll_once()) for _ in range(4)) >= 2
    second.run_phase()
    second.drain()
    second.close()
    assert sum(len(ShardMerger(ctx, 0).poll_once()) for _ in range(4)) >= 2
    assert audit_run(ctx).ok

"""Fragmented learners in cohorts (`fragments.cohorts`) and with prefetched lanes (`learner.prefetch`).

- cohorts 2: learner k's fragment schedule is offset by (k % 2) * H / 2 steps, so half a phase in, learner 0
  has shipped the fragments due in the first half of a phase and learner 1 those of the second; a rejoin keeps
  the offset; a bad value is refused naming the key.
- the model out of a fragmented run (sample, exports) is its run version put together from every fragment, not
  the root chain's version 0.
- prefetch: each lane's prefetcher fetches its fragment's newer versions; the learner installs them at its
  next step past the overlap without a request of its own, with the bits every learner and the merger hold.
Run: .venv/bin/pytest tests/integration/test_fragment_cohorts.py -q
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from diloco.configs import ConfigError, load_config
from diloco.learner import install
from diloco.learner.learner import Learner
from diloco.learner.prefetch import fetch_global
from diloco.merger.loop import ShardMerger
from diloco.run.chain_state import params_at
from diloco.run.create import create_run
from diloco.run.fragments import fragment_context
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store, read_latest
from diloco.storage.keys import parse_delta_key

H, COUNT = 8, 4


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config("tiny").data)


def _run(tmp_path, **overrides):
    cfg = load_config("tiny").with_overrides({
        "run.num_learners": 2, "merger.quorum": 1, "merger.grace_cap_s": 0.0, "learner.codec": "int8",
        "inner.steps_per_phase": H, "learner.local_state_every_steps": 0, "learner.checkpoint": False,
        "fragments.count": COUNT, "fragments.overlap_steps": 1, "merger.shards": 1, **overrides})
    return create_run(open_store(f"file://{tmp_path}/bucket"), f"c-{uuid.uuid4().hex[:6]}", cfg)


def _learner(ctx, name: str, corpus) -> Learner:
    """A learner that ships every fragment when due: slow storage would defer a ship (tested in
    test_fragment_lanes) and these tests count the ships."""
    learner = Learner(ctx, name, make_spec(ctx.cfg, corpus))
    learner.publisher.full = lambda *_: False  # a ship waits for room instead
    return learner


def _shipped(ctx, name: str) -> set[int]:
    """The fragments `name` has a delta in."""
    out = set()
    for p in range(COUNT):
        keys = ctx.keys.for_fragment(p)
        if any((parsed := parse_delta_key(k)) and parsed[0] == name
               for k in ctx.store.list(keys.deltas_prefix())):
            out.add(p)
    return out


def test_cohorts_offset_each_learners_schedule_by_half_a_phase(tmp_path, corpus) -> None:
    ctx = _run(tmp_path, **{"fragments.cohorts": 2})
    learners = [_learner(ctx, name, corpus) for name in ctx.learners]
    for learner in learners:
        learner.join()
    assert [learner.stagger() for learner in learners] == [0, H // 2]
    for learner in learners:
        learner.run_phase(num_steps=H // 2)
        learner.drain()
    # fragment p is due at step p * H / COUNT (+ H/2 for learner 1) of every phase; step 0 of a phase is step
    # H
    assert _shipped(ctx, ctx.learners[0]) == {1, 2}  # due at steps 2 and 4
    assert _shipped(ctx, ctx.learners[1]) == {3, 0}  # due at its steps 6 and 8 (= 4 + 2, 4 + 4)
    learners[1].close()
    again = _learner(ctx, ctx.learners[1], corpus)
    again.join()
    assert again.steps_done == H // 2  # a rejoin keeps the learner's cohort
    again.close()
    learners[0].close()


def test_a_bad_cohorts_value_is_refused_naming_the_key() -> None:
    cfg = load_config("tiny")
    for bad in (0, -1, "two"):
        with pytest.raises(ConfigError, match="fragments.cohorts"):
            cfg.with_overrides({"fragments.cohorts": bad})
    with pytest.raises(ConfigError, match=r"fragments.cohorts \(9\) must be <= inner.steps_per_phase \(8\)"):
        cfg.with_overrides({"inner.steps_per_phase": 8, "fragments.cohorts": 9})


def test_prefetched_lanes_install_the_merged_fragment_bit_for_bit(tmp_path, corpus, monkeypatch) -> None:
    ctx = _run(tmp_path, **{"learner.prefetch": True, "learner.prefetch_poll_s": 0.02,
                            "learner.probe_every_steps": 1000})  # installs only through the prefetchers
    learners = [_learner(ctx, name, corpus) for name in ctx.learners]
    for learner in learners:
        learner.join()
    assert all(len(learner.lane_prefetch) == COUNT for learner in learners)
    shard = ShardMerger(ctx, 0)
    learners[0].run_phase(num_steps=H)  # ships every fragment once
    learners[0].drain()
    merged, deadline = [], time.time() + 30
    # as run_merger polls (a pass may find one not due yet)
    while len(merged) < COUNT and time.time() < deadline:
        merged += shard.poll_once()
    assert sorted(m.version for m in merged) == [1] * COUNT
    reader = learners[1]
    deadline = time.time() + 30
    while time.time() < deadline and any(pf.fetches == 0 for pf in reader.lane_prefetch.values()):
        time.sleep(0.02)
    assert all(pf.fetches == 1 for pf in reader.lane_prefetch.values())
    def no_probe(*args, **kwargs):
        raise AssertionError("the training thread probed the bucket: a prefetched lane needs no request")

    monkeypatch.setattr(install, "manifest_exists", no_probe)
    moved = reader.maybe_install()
    assert sorted(moved) == list(range(COUNT))
    for p in range(COUNT):
        lane, keys = reader.lanes.lanes[p], ctx.keys.for_fragment(p)
        assert lane.base == read_latest(ctx.store, keys).version == 1
        glob0 = params_at(fragment_context(ctx, p), 0)[0]
        expected, _ = fetch_global(fragment_context(ctx, p), ctx.store, 0, glob0, 1, 4)  # G_0 + update_1
        assert lane.glob.keys() == expected.keys()
        for name, value in lane.glob.items():
            assert torch.equal(value, expected[name]), (p, name)
    assert reader.maybe_install() == []  # nothing new: nothing installed
    prefetchers = list(reader.lane_prefetch.values())
    for learner in learners:
        learner.close()
    assert reader.lane_prefetch == {} and not any(pf._thread.is_alive() for pf in prefetchers)


def test_one_poll_of_the_heads_wakes_the_lanes_that_moved(tmp_path, corpus) -> None:
    """A fragmented learner's lanes learn of new versions from one poll of the merger shard's heads (written
    after each commit), not from a poll per lane: with the lanes' own polls 10 minutes apart, every lane still
    fetches its merged version within seconds; heads that are garbage are no news."""
    from diloco.storage.heads import read_heads

    ctx = _run(tmp_path, **{"learner.prefetch": True, "learner.prefetch_poll_s": 0.02,
                            "learner.prefetch_idle_poll_s": 600.0, "learner.probe_every_steps": 1000})
    learners = [_learner(ctx, name, corpus) for name in ctx.learners]
    for learner in learners:
        learner.join()
    reader = learners[1]
    shard = ShardMerger(ctx, 0)
    time.sleep(0.3)
    assert all(pf.polls == 1 for pf in reader.lane_prefetch.values())  # each lane's first; then idle
    assert reader.heads is not None and reader.heads.polls > 3  # the watcher polls, finding no heads yet
    learners[0].run_phase(num_steps=H)  # ships every fragment once
    learners[0].drain()
    merged, deadline = [], time.time() + 30
    while len(merged) < COUNT and time.time() < deadline:
        merged += shard.poll_once()
    assert read_heads(ctx.store, ctx.keys, 0) == {p: 1 for p in range(COUNT)}
    deadline = time.time() + 30
    while time.time() < deadline and any(pf.fetches == 0 for pf in reader.lane_prefetch.values()):
        time.sleep(0.02)
    assert all(pf.fetches == 1 for pf in reader.lane_prefetch.values())  # woken: not the 600 s idle poll
    assert all(pf.polls <= 3 for pf in reader.lane_prefetch.values())
    ctx.store.put(ctx.keys.heads(0), b"\x00garbage{")
    reader.heads.poll()  # no news, no error
    assert read_heads(ctx.store, ctx.keys, 0) is None
    for learner in learners:
        learner.close()
    assert reader.heads is None


def test_a_fragmented_runs_model_is_its_run_version(tmp_path, corpus) -> None:
    from diloco.inspect.model_out import version_params
    from diloco.run.context import RunError
    from diloco.run.fragments import read_run_version

    ctx = _run(tmp_path)
    learner = _learner(ctx, ctx.learners[0], corpus)
    learner.join()
    learner.run_phase(num_steps=H)
    learner.drain()
    shard, merged, deadline = ShardMerger(ctx, 0), [], time.time() + 30
    while len(merged) < COUNT and time.time() < deadline:
        merged += shard.poll_once()
    learner.close()
    version, params = version_params(ctx)
    assert version == 1
    expected, start = read_run_version(ctx, 1)[0], version_params(ctx, 0)[1]
    assert params.keys() == expected.keys() == start.keys()
    assert all(torch.equal(params[k], expected[k]) for k in params)
    assert any(not torch.equal(params[k], start[k]) for k in params)  # trained: not version 0
    with pytest.raises(RunError, match="no committed run version 2"):
        version_params(ctx, 2)

"""Bucket checkpoints, for a lost host (learner.checkpoint_every, learner.checkpoint_moments): a pointer after
every delta, the moments every C phases under fresh keys (generations before the previous one deleted, nothing
overwritten but the pointer), int8 moments within their bound (exp_avg_sq never below the exact value), a
resume on a new host from a C-phase-old checkpoint (the step and data cursor of the last delta, the moments of
C phases before), a time budget, and a run made before pointers (its single checkpoint/state object is still
read). Run: .venv/bin/pytest tests/integration/test_checkpoints.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco.configs import load_config
from diloco.learner.checkpoint import Checkpointer, read_pointer, round_trip
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.run.events import EventLog, read_events
from diloco.run.objects import encode_tensors
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store
from diloco.storage.keys import RunKeys

OVERRIDES = {"run.num_learners": 1, "merger.quorum": 1, "merger.grace_cap_s": 0.0,
             "learner.local_state_every_steps": 0}  # a new host: no local state to resume from


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config("tiny").data)


def _run(tmp_path, **overrides):
    cfg = load_config("tiny").with_overrides({**OVERRIDES, **overrides})
    return create_run(open_store(f"file://{tmp_path}/bucket"), "ckpt", cfg)


def _learner(ctx, corpus) -> Learner:
    events = EventLog(ctx.store, ctx.keys, "local-0")
    return Learner(ctx, "local-0", make_spec(ctx.cfg, corpus), events=events)


def test_moments_every_c_phases_under_fresh_keys_and_a_new_host_resumes_from_them(tmp_path, corpus):
    ctx = _run(tmp_path, **{"learner.checkpoint_every": 3, "learner.checkpoint_moments": "int8"})
    merger = Merger(ctx)
    merger.load()
    first = _learner(ctx, corpus)
    first.join()
    exact = {}
    for phase in range(9):  # deltas 0..8: moments after 2, 5 and 8
        first.publish(first.run_phase())
        first.publisher.drain()
        merger.merge_once()
        if phase == 8:
            exact = dict(first.trainer.export_state()[0])
    pointer = read_pointer(ctx.store, ctx.keys, "local-0")
    assert (pointer.seq, pointer.step, pointer.cursor) == (8, first.trainer.step, first.cursor)
    assert pointer.moments.seq == 8 and pointer.moments.encoding == "int8"
    folder = ctx.keys.learner_prefix("local-0") + "checkpoint/"
    parts = sorted(k.rsplit("/", 1)[-1][:13] for k in ctx.store.list(folder) if "/m0" in k)
    assert set(parts) == {"m000000000005", "m000000000008"}  # the newest and the previous generation only
    first.events.flush()
    written = [e for e in read_events(ctx.store, ctx.keys) if e["kind"] == "checkpoint"]
    assert [e["seq"] for e in written] == list(range(9))
    assert [e["seq"] for e in written if e["moments_bytes"]] == [2, 5, 8]
    moments_bytes = max(e["moments_bytes"] for e in written)
    params = sum(p.numel() for p in first.model.parameters())
    assert moments_bytes < 2.5 * params  # int8: ~2 B/param, not fp32's ~8
    first.publish(first.run_phase())  # delta 9: its pointer names the moments of delta 8 (one phase old)
    first.publisher.drain()
    step, cursor = first.trainer.step, first.cursor
    first.close()

    again = _learner(ctx, corpus)  # a new host
    again.join()
    assert (again.trainer.step, again.cursor, again.state.seq) == (step, cursor, 10)
    state = dict(again.trainer.export_state()[0])
    assert state.keys() == exact.keys()
    for key, value in exact.items():
        if key.startswith("exp_avg/"):
            assert torch.allclose(state[key], value, atol=float(value.abs().max()) / 127 + 1e-12), key
        elif key.startswith("exp_avg_sq/"):
            assert bool((state[key] >= value * (1 - 1e-6)).all()), key  # never below: a step never larger
    again.close()


def test_a_time_budget_writes_the_moments_once_it_has_passed(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("diloco.learner.checkpoint.time.time", lambda: clock[0])
    writer = Checkpointer(RunKeys("r"), "local-0", "f", "90s", "int8")
    writer.joined(None)
    assert [writer.due() for _ in range(5)] == [False] * 5
    clock[0] += 91
    assert writer.due()


def test_a_run_made_before_pointers_resumes_from_its_single_checkpoint_object(tmp_path, corpus):
    ctx = _run(tmp_path)
    first = _learner(ctx, corpus)
    first.join()
    first.publish(first.run_phase())
    first.publisher.drain()
    tensors, meta = first.trainer.export_state()
    legacy = {"learner": "local-0", "seq": 0, "step": first.trainer.step, "cursor": first.cursor,
              "base_version": 0, "optimizer": meta}
    first.close()
    # a run made before pointers has none, but this one object: the optimizer's state in fp32
    ctx.store.delete(ctx.keys.checkpoint("local-0", "pointer.json"))
    data = encode_tensors(tensors, codec_name="fp32", kind="state", fingerprint=ctx.fingerprint, meta=legacy)
    ctx.store.put(ctx.keys.checkpoint("local-0", "state"), data)
    again = _learner(ctx, corpus)
    again.join()
    assert (again.trainer.step, again.cursor) == (legacy["step"], legacy["cursor"])
    back = again.trainer.export_state()[0]
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    again.close()


def test_int8_moments_round_trip_within_their_bound_and_a_quarter_of_fp32():
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(4096, 64, generator=gen) * 1e-3
    v = torch.exp(torch.randn(4096, 64, generator=gen) * 3.0) * 1e-8  # six orders of magnitude
    tensors = {"exp_avg/w": m, "exp_avg_sq/w": v}
    back, exact = round_trip(tensors, "int8"), round_trip(tensors, "fp32")
    assert back["bytes"] < exact["bytes"] / 3.5
    assert torch.equal(exact["tensors"]["exp_avg/w"], m) and torch.equal(exact["tensors"]["exp_avg_sq/w"], v)
    blocks = m.reshape(-1, 256).abs().amax(dim=1, keepdim=True)  # the codec's int8 blocks
    err = (back["tensors"]["exp_avg/w"] - m).reshape(-1, 256).abs()
    assert bool((err <= blocks / 254 * (1 + 1e-5)).all())
    root, got = v.sqrt().reshape(-1, 256), back["tensors"]["exp_avg_sq/w"].reshape(-1, 256)
    assert bool((got >= v.reshape(-1, 256) * (1 - 1e-6)).all())  # rounded up: never below
    assert bool((got.sqrt() - root <= root.amax(dim=1, keepdim=True) / 127 * (1 + 1e-5)).all())
    assert np.isfinite(got.numpy()).all()

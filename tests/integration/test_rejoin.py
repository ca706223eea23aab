"""Rejoin: a learner restarted on another host (no local state) starts from the newest version, continues its
seq, and resumes its optimizer step and data cursor from the checkpoint written after its last published
delta. Also: the corpus can come from an fsspec URL.
Run: .venv/bin/pytest tests/integration/test_rejoin.py -q
"""

from __future__ import annotations

import uuid

import fsspec

from diloco.configs import DataConfig, load_config
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.run.events import EventLog, read_events
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store


def test_restarted_learner_resumes_cursor_step_and_seq(tmp_path):
    cfg = load_config("tiny").with_overrides({"run.num_learners": 1, "merger.quorum": 1,
                                              "merger.grace_cap_s": 0.0,
                                              "learner.local_state_every_steps": 0})
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "rejoin", cfg)
    corpus = load_corpus(cfg.data)
    first = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus),
                    events=EventLog(ctx.store, ctx.keys, "local-0"))
    first.join()
    merger = Merger(ctx)
    merger.load()
    for _ in range(2):
        first.run_phase()
        first.publish()
        first.publisher.drain()
        merger.merge_once()
    first.events.flush()  # as every phase task does
    published_cursor, published_step = first.cursor, first.trainer.step
    first.run_phase()  # a phase that never ships: its batches must be read again after the crash
    first.publisher.close()  # the crash: nothing more reaches the bucket

    second = Learner(ctx, "local-0", make_spec(ctx.cfg, corpus),
                     events=EventLog(ctx.store, ctx.keys, "local-0"))
    assert second.join() == merger.version == 2
    assert second.state.seq == 2  # never reuses a seq
    assert second.cursor == published_cursor  # the unshipped phase is replayed, nothing skipped
    assert second.trainer.step == published_step  # the schedule continues where the shipped work ended
    second.close()
    kinds = [e["kind"] for e in read_events(ctx.store, ctx.keys) if e.get("learner") == "local-0"]
    assert "resume" in kinds and kinds.count("join") == 2


def test_corpus_from_an_fsspec_url():
    fs = fsspec.filesystem("memory")
    root = f"/corpus-{uuid.uuid4().hex[:8]}"
    fs.pipe(f"{root}/a.txt", b"To be, or not to be, that is the question. " * 40)
    fs.pipe(f"{root}/b.md", b"Now is the winter of our discontent. " * 40)
    fs.pipe(f"{root}/skip.bin", b"\x00" * 100)
    corpus = load_corpus(DataConfig(corpus=f"memory://{root}"))
    assert b"winter" in corpus.heldout.tobytes() or b"winter" in corpus.train.tobytes()
    assert b"\x00" * 50 not in corpus.train.tobytes()
    assert len(corpus.train) > len(corpus.heldout) > 0

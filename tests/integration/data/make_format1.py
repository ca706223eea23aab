"""Writes tests/integration/data/format1/: two small runs (P = 1 and P = 2) in storage format 1 — every
version holds its full params and outer state, as runs made before the log (issue #41) do — for
tests/integration/test_log_state.py::test_a_run_of_the_format_before_the_log_still_audits_exports_and_forks.

Not a test module. It must run with the code that writes format 1 (commit 6740566, before the log): git
archive 6740566 | tar -x -C /tmp/old && cd /tmp/old && PYTHONPATH=$PWD python \
<checkout>/tests/integration/data/make_format1.py <checkout>/tests/integration/data/format1
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from diloco.configs import load_config
from diloco.learner.learner import Learner
from diloco.merger.loop import ShardMerger
from diloco.run.context import open_run
from diloco.run.create import create_run
from diloco.storage import open_store

OVERRIDES = {"model.d_model": 16, "model.n_head": 2, "model.n_layer": 1, "model.ctx_len": 16,
             "run.num_learners": 2, "merger.quorum": 2, "inner.steps_per_phase": 4,
             "learner.probe_every_steps": 2,
             "inner.dylu": False, "learner.local_state_every_steps": 0, "learner.prefetch": False,
             "learner.checkpoint": False, "outer.momentum": 0.5, "outer.update_codec": "int4",
             "learner.codec": "int4", "data.batch_size": 2}


def make(root: Path, run_id: str, fragments: int, rounds: int = 4) -> None:
    cfg = load_config("tiny").with_overrides({**OVERRIDES, "fragments.count": fragments})
    url = f"file://{root}"
    create_run(open_store(url), run_id, cfg)
    ctx = open_run(url, run_id)
    learners = [Learner(ctx, name) for name in ctx.learners]
    for learner in learners:
        learner.publisher.full = lambda *_: False
        learner.join()
    merger = ShardMerger(ctx, 0)
    for _ in range(rounds):
        for learner in learners:
            learner.publish(learner.run_phase())
            learner.drain() if ctx.fragments else learner.publisher.drain()
        assert merger.merge_waiting() >= 1
        for learner in learners:
            learner.maybe_install()
    for learner in learners:
        learner.close()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    shutil.rmtree(out, ignore_errors=True)
    make(out, "old-p1", 1)
    make(out, "old-p2", 2)
    for junk in [*out.rglob("events"), *out.rglob("learners")]:  # not what the test is about
        shutil.rmtree(junk, ignore_errors=True)

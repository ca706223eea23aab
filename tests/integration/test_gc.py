"""Orphan collection: objects a crashed merge left under global/ and guard/ are deleted once old enough;
everything a manifest references stays, and the audit still replays every version. Retention (`gc
--keep-versions`, `--before`): tests/integration/test_log_state.py. Run: .venv/bin/pytest
tests/integration/test_gc.py -q
"""

from __future__ import annotations

import contextlib
import time

from diloco.configs import load_config
from diloco.inspect.audit import audit_run
from diloco.inspect.gc import collect_orphans
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store
from diloco.storage.heads import read_heads, write_heads


class CrashBeforeManifest(Exception):
    pass


def test_orphans_of_a_crashed_merge_are_collected(tmp_path):
    cfg = load_config("tiny").with_overrides({"run.num_learners": 1, "merger.quorum": 1,
                                              "merger.grace_cap_s": 0.0})
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "gc", cfg)
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, load_corpus(cfg.data)))
    learner.join()

    def crash(stage: str) -> None:
        if stage == "before_manifest":
            raise CrashBeforeManifest

    crashing = Merger(ctx, "crashing", stage_hook=crash)
    crashing.load()
    learner.run_phase()
    learner.publish()
    learner.publisher.drain()
    with contextlib.suppress(CrashBeforeManifest):
        crashing.merge_once()
    merger = Merger(ctx)
    merger.load()
    assert merger.merge_once() is not None  # the delta is merged once, by the survivor
    learner.close()
    write_heads(ctx.store, ctx.keys, 0, "merger", {0: 1})  # a shard's heads (fragmented runs): no orphan

    fresh = collect_orphans(ctx)  # too young: a live merger may be about to commit them
    # the crash's update and its outlier window (written before the manifest it never committed)
    assert len(fresh.orphans) == 2 and not fresh.deleted and len(fresh.too_young) == 2
    dry = collect_orphans(ctx, min_age_s=60, now=time.time() + 3600, dry_run=True)
    assert not dry.deleted and len(dry.orphans) == 2
    report = collect_orphans(ctx, min_age_s=60, now=time.time() + 3600)
    assert sorted(report.deleted) == sorted(fresh.orphans)
    assert sorted(k.startswith(ctx.keys.global_prefix()) for k in report.deleted) == [False, True]
    assert any(k.startswith(ctx.keys.guard_prefix()) for k in report.deleted)
    audit = audit_run(ctx)
    assert audit.ok and audit.replay_ok and audit.deltas_merged == 1, audit.problems
    assert collect_orphans(ctx, min_age_s=0).orphans == []
    assert read_heads(ctx.store, ctx.keys, 0) == {0: 1}

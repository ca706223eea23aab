"""The streaming row of `bench quality`: decoupled int4 with P fragments shipped on the staggered schedule
(fragments.count = P, overlap tau = 2), merged by the sharded merger, driven in-process like the engine rows.

Contract: deterministic (CPU, fixed seeds; each round the learners of the method's arrival schedule run a
phase chunk by chunk, in step: every learner ("all", quorum M) or one cohort of two half a phase apart
("alternate", the decoupled rows' schedule: even learners on even rounds, odd on odd, quorum M/2); chunks are
cut at every ship (fragment p at step p*H/P) and tau steps after it; after each chunk what was just shipped is
merged and each learner of the round installs every fragment merged at least tau steps after it shipped it:
back tau steps after its ship; a learner whose cohort sat out installs the other cohort's merges at its first
chunk); exactly `num_learners * steps * batch_size * ctx_len` training tokens; the held-out loss of the run
version (every fragment's version put together); bytes measured by each learner's counting store.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace

from diloco.configs import Config
from diloco.learner.fragmented import FragmentLearner
from diloco.merger.shard import ShardMerger
from diloco.run.create import create_run
from diloco.run.fragments import read_run_version, run_version
from diloco.specs.gpt import make_spec
from diloco.specs.text import Corpus
from diloco.storage import open_store
from diloco.storage.traffic import CountingStore
from diloco.training.fragments import due_offset

OVERLAP_STEPS = 2  # the paper's tau


def run_streaming(cfg: Config, method, corpus: Corpus, held, steps: int):
    """Learners (FragmentLearner) and one merger shard in this process on a file:// store."""
    from diloco.bench._quality_runs import RunResult, active_learners, quorum_of, tokens_per_phase

    t0, m = time.time(), cfg.run.num_learners
    cfg = cfg.with_overrides({
        "learner.codec": method.codec, "learner.mode": method.mode, "learner.checkpoint": False,
        "learner.local_state_every_steps": 0, "learner.prefetch": False, "learner.device": "cpu",
        "merger.grace_cap_s": 0.0, "merger.quorum": quorum_of(method.schedule, m), "fragments.count": method.fragments,
        "fragments.overlap_steps": OVERLAP_STEPS, "merger.shards": 1,
        "learner.probe_every_steps": 1 << 20,  # installs at the chunk boundaries below, never inside a chunk
        **dict(method.overrides)})
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        store = open_store(f"file://{tmp}")
        ctx = create_run(store, f"q-{method.name}-s{cfg.data.seed}", cfg)
        counters = [CountingStore(store) for _ in ctx.learners]
        learners = [FragmentLearner(replace(ctx, store=c), n, make_spec(ctx.cfg, corpus))
                    for c, n in zip(counters, ctx.learners, strict=True)]
        for learner, counter in zip(learners, counters, strict=True):
            learner.join()
            counter.reset()  # the initial download is not per-step traffic (DP has it too)
        shard = ShardMerger(ctx, 0)
        target = m * steps * cfg.data.batch_size * cfg.model.ctx_len
        curve, tokens, merges, r, next_eval = [(0, held.loss(read_run_version(ctx, 0)[0]))], 0, 0, 0, 0
        h, count = cfg.inner.steps_per_phase, method.fragments
        bounds = [due_offset(p, count, h) for p in range(count)] + [h]
        cuts = sorted({b for start in bounds[:-1] for b in (start, min(start + OVERLAP_STEPS, h))} | {h})
        while True:
            active = [learners[i] for i in active_learners(method.schedule, m, r)]
            if tokens + len(active) * tokens_per_phase(cfg) > target:
                break
            for start, end in zip(cuts, cuts[1:], strict=False):  # ships at the bounds, installs tau after
                for learner in active:
                    tokens += learner.run_phase(num_steps=end - start).tokens
                for learner in active:
                    learner.publisher.drain()
                merges += len(shard.poll_once())  # the fragment every active learner just shipped
                for learner in active:
                    learner.maybe_install()  # what was shipped at least tau steps ago and merged since
            r += 1
            if tokens >= next_eval:  # every M phases' tokens (each round under "all", every other under "alternate")
                curve.append((tokens, held.loss(read_run_version(ctx, run_version(ctx))[0])))
                next_eval = tokens + m * tokens_per_phase(cfg)
        if curve[-1][0] != tokens:
            curve.append((tokens, held.loss(read_run_version(ctx, run_version(ctx))[0])))
        for learner in learners:
            learner.close()
        versions = run_version(ctx)
    sent = [c.sent["delta"] for c in counters]
    received = [c.received["global"] for c in counters]
    extra = {"versions": versions, "fragment_merges": merges, "fragments": method.fragments,
             "overlap_steps": OVERLAP_STEPS, "sent_per_learner": sent, "received_per_learner": received}
    return RunResult(curve[-1][1], curve, tokens, sum(sent) / m, sum(received) / m, time.time() - t0, extra)

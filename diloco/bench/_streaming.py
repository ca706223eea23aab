"""The streaming row of `bench quality`: decoupled int4 with P fragments shipped on the staggered schedule
(fragments.count = P, overlap tau = the recipe's fragments.overlap_steps, 2 by default, the paper's), merged
by the sharded merger, driven in-process like the engine rows.

Contract: deterministic (CPU, fixed seeds); exactly `num_learners * steps * batch_size * ctx_len` training
tokens; the held-out loss of the run version (every fragment's version put together); bytes measured by each
learner's counting store. Two drives:
- rounds ("all", "alternate", "hetero"): each round the learners of the method's arrival schedule run a phase
  chunk by chunk, in step: every learner ("all", quorum M) or one cohort of two ("alternate", the decoupled
  rows' schedule: even learners on even rounds, odd on odd, quorum M/2: the cohorts take turns, one computes
  while the other waits); chunks are cut at every ship (fragment p at step p*H/P) and tau steps after it;
  after each chunk what was just shipped is merged and each learner of the round installs every fragment
  merged at least tau steps after it shipped it; a learner whose cohort sat out installs the other cohort's
  merges at its first chunk.
- the clock ("concurrent": two cohorts half a phase apart, fragments.cohorts 2, quorum M/2; "concurrent-full":
  every learner in step, quorum M; "concurrent-hetero": the cohorts, the second half of the learners 2x
  slower): every learner computes at once, one step a tick (a 2x slower learner every other tick), as real
  learners do; after each tick the shard merges what has its quorum, and a learner's probe at the end of each
  step installs what was merged at least tau steps after it shipped it (links without latency: the best case
  of a real run).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace

from diloco.configs import Config
from diloco.learner.learner import Learner
from diloco.merger.loop import ShardMerger
from diloco.run.create import create_run
from diloco.run.fragments import read_run_version, run_version
from diloco.specs.gpt import make_spec
from diloco.specs.text import Corpus
from diloco.storage import open_store
from diloco.storage.traffic import CountingStore
from diloco.training.fragments import due_offset


def run_streaming(cfg: Config, method, corpus: Corpus, held, steps: int):
    """Learners (over fragment lanes) and one merger shard in this process on a file:// store."""
    from diloco.bench._quality_runs import active_learners, quorum_of, tokens_per_phase

    t0, m = time.time(), cfg.run.num_learners
    clock = method.schedule.startswith("concurrent")
    cfg = cfg.with_overrides({
        "learner.codec": method.codec, "learner.mode": method.mode,
        "learner.local_state_every_steps": 0, "learner.prefetch": False, "learner.device": "cpu",
        "merger.grace_cap_s": 0.0, "merger.quorum": quorum_of(method.schedule, m),
                              "fragments.count": method.fragments,
        "merger.shards": 1, "inner.dylu": method.dylu,
        # the round drive installs at its chunk boundaries, never inside a chunk; the clock probes every step
        "learner.probe_every_steps": 1 if clock else 1 << 20,
        # on the clock two cohorts half a phase apart (concurrent) or everyone in step (concurrent-full); a
        # merge waits for its quorum, never for a wall-clock timeout (the drive is deterministic)
        **({"fragments.cohorts": 1 if "full" in method.schedule else 2, "merger.quorum_timeout_s": 1e9}
           if clock else {}),
        **dict(method.overrides)})
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        store = open_store(f"file://{tmp}")
        ctx = create_run(store, f"q-{method.name}-s{cfg.data.seed}", cfg)
        counters = [CountingStore(store) for _ in ctx.learners]
        learners = [Learner(replace(ctx, store=c), n, make_spec(ctx.cfg, corpus))
                    for c, n in zip(counters, ctx.learners, strict=True)]
        for learner, counter in zip(learners, counters, strict=True):
            learner.join()
            counter.reset()  # the initial download is not per-step traffic (DP has it too)
        shard = ShardMerger(ctx, 0)
        target = m * steps * cfg.data.batch_size * cfg.model.ctx_len
        if clock:
            curve, tokens, merges = _drive_clock(ctx, learners, shard, held, target, method.schedule,
                                                 method.dylu)
            return _result(ctx, method, learners, counters, curve, tokens, merges, t0)
        curve, tokens, merges, r, next_eval = [(0, held.loss(read_run_version(ctx, 0)[0]))], 0, 0, 0, 0
        h, count, tau = cfg.inner.steps_per_phase, method.fragments, cfg.fragments.overlap_steps
        bounds = [due_offset(p, count, h) for p in range(count)] + [h]
        cuts = sorted({b for start in bounds[:-1] for b in (start, min(start + tau, h))} | {h})
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
            # every M phases' tokens (each round under "all", every other under "alternate")
            if tokens >= next_eval:
                curve.append((tokens, held.loss(read_run_version(ctx, run_version(ctx))[0])))
                next_eval = tokens + m * tokens_per_phase(cfg)
        if curve[-1][0] != tokens:
            curve.append((tokens, held.loss(read_run_version(ctx, run_version(ctx))[0])))
        return _result(ctx, method, learners, counters, curve, tokens, merges, t0)


def _drive_clock(ctx, learners: list[Learner], shard: ShardMerger, held, target: int, schedule: str,
                 dylu: bool = False):
    """Every learner computes at once, one step a tick (a learner of speed s < 1, the slow half under
    "concurrent-hetero", on a fraction s of the ticks): each steps (shipping what is due on its own staggered
    schedule, installing at its probe what was merged at least tau steps after its ship), then the shard
    merges every fragment whose quorum is there (visible from the next tick's probes). What the lanes hold
    when the budget is spent ships too, and is merged whatever its quorum. `dylu`: each learner's H from its
    speed by the engine's inner.dylu (diloco.learner.pace), H_w = floor(v_w / v_max * H), its place in the
    cycle kept (cohort offset H_w / cohorts), so every learner ships each fragment at the same wall rate and a
    cohort's deltas arrive together."""
    from diloco.bench._quality_runs import speeds_of, tokens_per_phase

    cfg, m = ctx.cfg, len(learners)
    curve, tokens, merges = [(0, held.loss(read_run_version(ctx, 0)[0]))], 0, 0
    every, speeds, credit = m * tokens_per_phase(cfg), speeds_of(schedule, m), [0.0] * m
    # the engine's DyLU (inner.dylu), the clock's speeds as the speeds measured: the lanes retimed to H_w
    if dylu:
        for learner, speed in zip(learners, speeds, strict=True):
            learner.pace.own_steps_per_s, learner.pace.peers_steps_per_s = speed, max(speeds)
            learner.next_phase_steps()
    next_eval, per_step = every, cfg.data.batch_size * cfg.model.ctx_len
    while tokens + per_step <= target:
        for i, learner in enumerate(learners):
            credit[i] += speeds[i]
            if credit[i] < 1.0 - 1e-9 or tokens + per_step > target:
                continue
            credit[i] -= 1.0
            tokens += learner.run_phase(num_steps=1).tokens
        for learner in learners:
            learner.publisher.drain()
        merges += len(shard.poll_once())
        if tokens >= next_eval:
            curve.append((tokens, held.loss(read_run_version(ctx, run_version(ctx))[0])))
            next_eval = tokens + every
    for learner in learners:
        for lane in learner.lanes.lanes:
            if lane.steps > 0:
                learner.ship(lane.index)
        learner.settle()
        learner.publisher.drain()
    merges += shard.merge_waiting()
    point = (tokens, held.loss(read_run_version(ctx, run_version(ctx))[0]))
    curve[-1:] = [point] if curve[-1][0] == tokens else [curve[-1], point]
    return curve, tokens, merges


def _result(ctx, method, learners, counters, curve, tokens: int, merges: int, t0: float):
    from diloco.bench._quality_runs import RunResult

    for learner in learners:
        learner.close()
    versions, m = run_version(ctx), len(learners)
    from diloco.bench._quality_runs import traffic_of

    sent, received, extra = traffic_of(counters)
    extra.update({"versions": versions, "fragment_merges": merges, "fragments": method.fragments,
                  "overlap_steps": ctx.cfg.fragments.overlap_steps})
    return RunResult(curve[-1][1], curve, tokens, sum(sent) / m, sum(received) / m, time.time() - t0, extra)

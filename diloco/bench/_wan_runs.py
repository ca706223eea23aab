"""The real runs behind `diloco bench wan`: M learner processes, each reaching the bucket through its own
capped link (ThrottledStore), the merger beside the bucket, every inner step padded to one compute time.

Contract: a run processes exactly M x steps x B x T training tokens (steps / H phases per learner); its
clock starts when every learner has joined; the loss curve is every committed version's held-out loss at
its commit time, evaluated after the run (so evaluation takes no CPU from the learners); bytes are what
each learner's link carried after its join, by object kind and in all.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.bench._quality_runs import HeldOut
from diloco.bench.throttle import LinkSpec
from diloco.configs import Config
from diloco.storage.traffic import CountingStore

JOIN_TIMEOUT_S = 120.0  # learners' imports and joins on a loaded 2-core box
EVAL_PROCS = 2  # after a run its versions are evaluated on both cores


@dataclass(frozen=True)
class WanRun:
    """One method behind one link: `mode` sync (quorum M, learners wait) or carry (the recipe's quorum and
    grace window; learners never wait). `cohorts`: odd learners start with half a phase (two cohorts half a
    phase apart, quorum M/2, no grace: the cohorts of bench quality's "alternate" schedule, computing at
    once). `fragments` > 1: learners ship fragment p at step p*H/P of every phase into its own chain and a
    merger shard merges each fragment once a quorum of its deltas is there (M in step; M/2 in cohorts:
    fragments.cohorts 2, the odd learners' schedule half a phase later); with the recipe's learner.prefetch
    each lane fetches its fragment's versions in the background."""

    name: str
    mode: str
    link: LinkSpec
    step_time_s: float
    steps: int  # inner steps per learner
    cohorts: bool = False
    fragments: int = 1  # > 1: streaming (fragments.count, tau = fragments.overlap_steps), one merger shard
    # real links (bench/links.py): the bucket's URL (a real S3 server), the LinkNet whose site i learner i
    # enters (its link then the kernel's, `link` only counts), steps unpadded when `pad` is False, and a cut
    # (site, at s after the clock's start, down s)
    storage_url: str | None = None
    sites: Any = None
    pad: bool = True
    cut: tuple[int, float, float] | None = None


@dataclass
class LearnerReport:
    name: str
    compute_s: float  # inner steps, padded to step_time_s: the emulated compute
    real_compute_s: float  # the same steps unpadded (this machine's CPU time per step, under its load)
    steps: int
    start_s: float  # from the run's clock
    end_s: float  # its last phase done (sync: decided)
    installs: int
    link: dict[str, float]
    sent: dict[str, int]
    received: dict[str, int]
    phase_ends_s: list[float] = field(default_factory=list)  # from the run's clock: when each phase ended
    steps_over_pad: int = 0  # steps whose real time passed step_time_s (padded runs: the pad too short)

    @property
    def busy(self) -> float:
        span = self.end_s - self.start_s
        return self.compute_s / span if span > 0 else 0.0


@dataclass
class WanResult:
    curve: list[tuple[float, float]]  # (seconds since the clock started, held-out nats/byte) per version
    final_loss: float
    versions: int
    wall_s: float
    learners: list[LearnerReport] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # real links: per learner, what its veth counted from the clock's start
    kernel: list[dict[str, int]] | None = None


class PaddedSteps:
    """Wraps a trainer's train_step: each step lasts at least `step_time_s` (the rest is slept), as if the
    site computed at that speed; counts the padded and the real time."""

    def __init__(self, trainer, step_time_s: float) -> None:
        self.step_time_s, self.compute_s, self.real_s, self.steps = step_time_s, 0.0, 0.0, 0
        self.over = 0  # steps that took longer than step_time_s by themselves
        self._inner = trainer.train_step
        trainer.train_step = self

    def __call__(self, *batch: Any) -> float:
        t0 = time.perf_counter()
        loss = self._inner(*batch)
        real = time.perf_counter() - t0
        if real < self.step_time_s:
            time.sleep(self.step_time_s - real)
        elif self.step_time_s > 0:
            self.over += 1
        self.compute_s += time.perf_counter() - t0
        self.real_s += real
        self.steps += 1
        return loss


def engine_overrides(cfg: Config, run: WanRun) -> dict[str, Any]:
    """Local state off (nothing restarts; it is this host's disk, not traffic); the bucket checkpoint at the
    engine's defaults (its pointer and moments share the uplink and are counted with every other object); the
    merger polls every 20 ms (a sync learner's wait is not a polling artefact)."""
    m = cfg.run.num_learners
    out: dict[str, Any] = {
        "learner.mode": run.mode, "learner.local_state_every_steps": 0,
        "learner.device": "cpu", "merger.poll_interval_s": 0.02, "inner.total_steps": run.steps,
        "run.num_versions": 1 << 30,
    }
    if run.mode == "sync":
        out.update({"merger.quorum": m, "merger.grace_cap_s": 0.0, "merger.quorum_timeout_s": 600.0})
    elif run.cohorts:
        out.update({"merger.quorum": max(1, m // 2), "merger.grace_cap_s": 0.0})
    if run.fragments > 1:
        if run.mode == "sync":
            raise ValueError("bench wan: fragments > 1 is for the decoupled (carry) rows")
        # a shard merges a fragment once its quorum is there (it has no grace window): every learner in step
        out.update({"fragments.count": run.fragments, "merger.shards": 1,
                    "fragments.cohorts": 2 if run.cohorts else 1,
                    "merger.quorum": max(1, m // 2) if run.cohorts else m})
    return out


def phase_plan(steps: int, h: int, half_first: bool) -> list[int]:
    """Steps of each phase: steps / H phases of H, or (the second cohort) H/2, then H, ..., then H/2."""
    plan = [h] * (steps // h)
    if half_first and h >= 2 and plan:
        plan = [h // 2, *plan[1:], h - h // 2]
    return plan


def _learner_main(url: str, run_id: str, name: str, run: WanRun, half_first: bool, corpus, barrier, out,
                  site: int = 0) -> None:
    """One learner process (forked: `corpus` is the parent's): join through its link, wait for everyone,
    then steps / H phases."""
    from diloco.bench.throttle import ThrottledStore
    from diloco.learner.learner import Learner
    from diloco.run.context import open_run
    from diloco.specs.gpt import make_spec
    from diloco.storage import open_store

    if run.sites is not None:
        run.sites.enter(site)  # before any socket: every byte to the bucket crosses its capped link
    torch.set_num_threads(1)
    try:
        counting = CountingStore(ThrottledStore(open_store(url), run.link))
        ctx = open_run(counting, run_id)
        fragmented = bool(ctx.fragments)
        learner = Learner(ctx, name, make_spec(ctx.cfg, corpus))
        padded = PaddedSteps(learner.trainer, run.step_time_s if run.pad else 0.0)
        learner.join()
        t0 = barrier_wait(barrier)
        # from the clock's start, as the parent reads the kernel's
        joined_link = counting.inner.link.snapshot()
        counting.reset()
        start, installs, phase_ends = time.time() - t0, 0, []
        for num_steps in phase_plan(run.steps, ctx.cfg.inner.steps_per_phase, half_first and not fragmented):
            stats = learner.run_phase(num_steps)
            seq = learner.publish(stats)
            if seq is not None and run.mode == "sync":
                learner.wait_for_decision(seq, timeout_s=ctx.cfg.merger.quorum_timeout_s)
            installs += len(stats.installs)
            phase_ends.append(time.time() - t0)
        end = time.time() - t0
        learner.close()
        link = {k: v - joined_link.get(k, 0) for k, v in counting.inner.link.snapshot().items()}
        out.put(("ok", name, LearnerReport(name, padded.compute_s, padded.real_s, padded.steps, start, end,
                                           installs, link, dict(counting.sent), dict(counting.received),
                                           phase_ends, padded.over)))
    # reported to the parent, which raises it: a bench must not hang on a dead child
    except BaseException as err:
        out.put(("error", name, f"{type(err).__name__}: {err}"))
        raise


def barrier_wait(barrier) -> float:
    """Wait for every learner and the parent; the clock's zero is when the last one arrived (each process
    reads it as it leaves the barrier: the same instant to within a scheduler tick)."""
    barrier.wait(JOIN_TIMEOUT_S)
    return time.time()


def _merge_until_done(merger, procs, drain, deadline_s: float) -> None:
    """Merge until every learner has reported (or exited) and nothing is pending; reports are read as they
    come (a child's queue must not fill while the parent merges)."""
    deadline = time.time() + deadline_s

    def done() -> bool:
        reported = len(drain()) == len(procs) or all(not p.is_alive() for p in procs)
        if time.time() > deadline:
            raise RuntimeError(f"run still going after {deadline_s:.0f}s: version {merger.version}, "
                               f"learners alive {[p.is_alive() for p in procs]}, reports {sorted(drain())}")
        return reported and merger.pending().num_learners == 0

    while not done():
        merger.merge_once(should_stop=done)
        if any(p.exitcode not in (None, 0) for p in procs):
            raise RuntimeError(f"a learner process died: {drain()}")


def _merge_fragments_until_done(shard, procs, drain, deadline_s: float) -> None:
    """A fragmented run's _merge_until_done: one shard merges every fragment due; once every learner reported,
    what still waits below its quorum (a cohort's last ships) is merged at once rather than after the
    timeout."""
    deadline = time.time() + deadline_s
    while True:
        reported = len(drain()) == len(procs) or all(not p.is_alive() for p in procs)
        if time.time() > deadline:
            raise RuntimeError(f"run still going after {deadline_s:.0f}s: versions "
                               f"{[shard.version(p) for p in shard.fragments]}, reports {sorted(drain())}")
        merged = shard.poll_once()
        if any(p.exitcode not in (None, 0) for p in procs):
            raise RuntimeError(f"a learner process died: {drain()}")
        if reported and not merged:
            shard.merge_waiting()
            return
        if not merged:
            time.sleep(shard.ctx.cfg.merger.poll_interval_s)


_EVAL: dict[str, Any] = {}  # in a forked evaluator: the run's context and the held-out set (_start_evaluator)


def _start_evaluator(ctx, held: HeldOut) -> None:
    import dataclasses

    from diloco.storage import open_store

    torch.set_num_threads(1)
    if not ctx.store.url.startswith("file://"):  # an S3 client is not fork-safe: each evaluator opens its own
        ctx = dataclasses.replace(ctx, store=open_store(ctx.store.url))
    _EVAL.update(ctx=ctx, held=held)


def _in_evaluators(ctx, held: HeldOut, fn, items: list) -> list:
    """fn over shares of `items` in EVAL_PROCS forked evaluators (ctx and held inherited, not pickled); one
    result per item, in order."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(EVAL_PROCS, mp_context=mp.get_context("fork"), initializer=_start_evaluator,
                             initargs=(ctx, held)) as pool:
        parts = list(pool.map(fn, [items[i::EVAL_PROCS] for i in range(EVAL_PROCS)]))
    return [parts[i % EVAL_PROCS][i // EVAL_PROCS] for i in range(len(items))]


def _curve(ctx, held: HeldOut, t0: float) -> list[tuple[float, float, int]]:
    """Every version's held-out loss, evaluated after the run (its learners are gone) by EVAL_PROCS forked
    processes, each a share of the versions (the same model, batches and bits as one process would use); a
    version's parameters from its checkpoint and updates (read_run_version), at P = 1 as for fragments."""
    return _run_version_curve(ctx, held, t0)


def _run_version_losses(versions: list[int]) -> list[tuple[float, float]]:
    """In a forked evaluator: (committed at, held-out loss) of each run version of a fragmented run."""
    from diloco.run.fragments import read_run_version

    ctx, held = _EVAL["ctx"], _EVAL["held"]
    out = []
    for version in versions:
        params, _, committed = read_run_version(ctx, version)
        out.append((committed, held.loss(params)))
    return out


def _run_version_curve(ctx, held: HeldOut, t0: float) -> list[tuple[float, float, int]]:
    """_curve of a fragmented run: every run version (each fragment's version v put together), at the time its
    last fragment committed it."""
    from diloco.run.fragments import run_version

    versions = list(range(run_version(ctx) + 1))
    points = _in_evaluators(ctx, held, _run_version_losses, versions)
    return [(max(0.0, at - t0), loss, v) for v, (at, loss) in zip(versions, points, strict=True)]


def run_wan(cfg: Config, run: WanRun, held: HeldOut, seed: int) -> WanResult:
    """One real run: learners forked from this process (torch already imported: a fork is fast), the merger
    here."""
    from diloco.merger.loop import ShardMerger
    from diloco.merger.merger import Merger
    from diloco.run.create import create_run
    from diloco.specs.gpt import load_corpus
    from diloco.storage import open_store

    cfg = cfg.with_overrides({**engine_overrides(cfg, run), "data.seed": seed})
    m, h = cfg.run.num_learners, cfg.inner.steps_per_phase
    if run.steps % h:
        raise ValueError(f"steps ({run.steps}) must be a multiple of inner.steps_per_phase ({h})")
    torch.set_num_threads(1)
    ctx_mp = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="diloco-wan-") as tmp:
        url = run.storage_url or f"file://{tmp}"
        ctx = create_run(open_store(url), f"wan-{run.name}", cfg)
        barrier, out, corpus = ctx_mp.Barrier(m + 1), ctx_mp.Queue(), load_corpus(cfg.data)
        half_first = [run.cohorts and i % 2 == 1 for i in range(m)]  # two cohorts half a phase apart
        procs = [ctx_mp.Process(target=_learner_main, args=(url, ctx.run_id, name, run, half_first[i], corpus,
                                                            barrier, out, i),
                                name=f"wan-{name}", daemon=True) for i, name in enumerate(ctx.learners)]
        for p in procs:
            p.start()
        if ctx.fragments:
            merger = ShardMerger(ctx, 0)
        else:
            merger = Merger(ctx)
            merger.load()
        barrier.wait(JOIN_TIMEOUT_S)
        t0 = time.time()
        kernel0 = run.sites.counters() if run.sites is not None else None
        cut = run.sites.cut(run.cut[0], run.cut[2], run.cut[1]) if run.cut else None
        reports: dict[str, Any] = {}

        def drain() -> dict[str, Any]:
            while not out.empty():
                status, name, body = out.get()
                reports[name] = (status, body)
            return reports

        expected_s = run.steps * run.step_time_s
        until_done = _merge_fragments_until_done if ctx.fragments else _merge_until_done
        until_done(merger, procs, drain, deadline_s=max(600.0,
                                                        20 * expected_s + (run.cut[2] if run.cut else 0)))
        merger.close()  # its checkpoint writer done before the run's directory goes
        for p in procs:
            p.join(30)
        kernel = None
        if kernel0 is not None:  # every learner has closed: nothing of theirs is on the links any more
            kernel = [{k: v - a[k] for k, v in b.items()} for a, b in zip(kernel0, run.sites.counters(),
                                                                          strict=True)]
        if cut is not None:
            cut.join(run.cut[1] + run.cut[2] + 30)
        errors = {k: v for k, (s, v) in reports.items() if s != "ok"}
        if errors or len(reports) < m:
            raise RuntimeError(f"{run.name}: learners failed: {errors or 'no report'}")
        learners = [reports[name][1] for name in ctx.learners]
        curve = _curve(ctx, held, t0)
        versions = curve[-1][2]
    wall = curve[-1][0]  # the clock's start to the last commit
    extra: dict[str, Any] = {"versions_per_phase": versions / max(1, run.steps // h)}
    if cut is not None:
        extra["cut_window_s"] = [t - t0 for t in cut.times] if cut.times else None
    return WanResult([(t, loss) for t, loss, _ in curve], curve[-1][1], curve[-1][2], wall, learners, extra,
                     kernel)


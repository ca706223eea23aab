"""The training runs behind `bench quality`: data-parallel, and the engine driven in-process.

Contract: every run is deterministic (CPU, fixed seeds, a fixed arrival schedule) and processes
exactly `num_learners * steps * batch_size * ctx_len` training tokens; bytes are measured.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from diloco.bench.bandwidth import allreduce_bytes_per_step
from diloco.configs import Config
from diloco.learner.learner import Learner
from diloco.learner.pace import phase_steps
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.specs.gpt import make_spec
from diloco.specs.text import Corpus
from diloco.storage import open_store
from diloco.storage.traffic import CountingStore
from diloco.training.data import ShardSampler, eval_batches
from diloco.training.inner import InnerTrainer, evaluate
from diloco.training.model import build_model, get_flat_params, set_params

EVAL_SEED = 0  # held-out batches are the same for every method and every seed


@dataclass(frozen=True)
class Method:
    """One way to train: `dp`, or the engine with a delta codec, learner mode and arrival schedule."""

    name: str
    kind: str  # "dp" | "engine" | "peer" | "streaming" (fragments: diloco.bench._streaming)
    codec: str = "fp32"
    mode: str = "carry"
    schedule: str = "all"  # "all" (every learner each round), "alternate" (half per round), "hetero",
    # "concurrent" (every learner computes at once, on a clock: diloco.bench._concurrent; two cohorts),
    # "concurrent-full" (in step, quorum M), "concurrent-hetero" (half the learners 2x slower)
    label: str = ""
    overrides: tuple[tuple[str, object], ...] = ()  # config overrides of this method (a lever under test)
    # concurrent-hetero (engine or streaming): each learner's H from its speed, H_w = floor(v_w / v_max * H)
    dylu: bool = False
    fragments: int = 1  # peer: torchft's streaming fragments (1 = plain DiLoCo); streaming: fragments.count


METHODS = (
    Method("dp", "dp", label="data-parallel (M x batch, AdamW every step)"),
    Method("sync-fp32", "engine", "fp32", "sync", "all", "synchronous DiLoCo, quorum M, fp32"),
    Method("decoupled-int8", "engine", "int8", "carry", "alternate",
           "decoupled, int8, half arrive per merge"),
    Method("decoupled-int4", "engine", "int4", "carry", "alternate",
           "decoupled, int4, half arrive per merge"),
    Method("hetero-int4", "engine", "int4", "carry", "hetero", "decoupled int4, half the learners 2x slower"),
    Method("streaming-int4", "streaming", "int4", "carry", "all",
           "Streaming: decoupled int4, 4 fragments staggered over the phase, tau 2, sharded merger",
           fragments=4),
    Method("streaming-alt-int4", "streaming", "int4", "carry", "alternate",
           "streaming-int4 on the decoupled rows' schedule: two cohorts taking turns, quorum M/2",
           fragments=4),
    Method("streaming-hetero-int4", "streaming", "int4", "carry", "hetero",
           "streaming-int4 with half the learners 2x slower (hetero-int4's schedule, quorum M/2)",
           fragments=4),
    Method("streaming-clock-int4", "streaming", "int4", "carry", "concurrent",
           "streaming-alt-int4 with every learner computing at once (two cohorts half a phase apart, a step "
           "a tick)",
           fragments=4),
    Method("streaming-clock-full-int4", "streaming", "int4", "carry", "concurrent-full",
           "streaming-int4 with every learner computing at once, in step (quorum M, a step a tick)",
           fragments=4),
    Method("streaming-clock-hetero-int4", "streaming", "int4", "carry", "concurrent-hetero",
           "streaming-clock-int4 with half the learners 2x slower", fragments=4),
    Method("streaming-clock-hetero-dylu", "streaming", "int4", "carry", "concurrent-hetero",
           "streaming-clock-hetero-int4, each learner's H from its speed (DyLU)", dylu=True, fragments=4),
    Method("torchft-diloco", "peer", "fp32", "sync", "all", "torchft 0.2.0 DiLoCo (Manager + gloo, its outer "
                                                            "Nesterov)"),
    Method("torchft-streaming", "peer", "fp32", "sync", "all",
           "torchft 0.2.0 Streaming DiLoCo: 2 fragments, sync delay 1, alpha 0.5", fragments=2),
    Method("clock-int4", "engine", "int4", "carry", "concurrent",
           "decoupled int4, every learner computing at once (two cohorts half a phase apart)"),
    Method("clock-full-int4", "engine", "int4", "carry", "concurrent-full",
           "decoupled int4 on the clock, every learner in step, quorum M (one merge a phase, nobody waits)"),
    Method("clock-hetero-int4", "engine", "int4", "carry", "concurrent-hetero",
           "clock-int4 with half the learners 2x slower"),
    Method("clock-hetero-dylu", "engine", "int4", "carry", "concurrent-hetero",
           "clock-hetero-int4, each learner's H from its speed (DyLU)", dylu=True),
)


@dataclass
class RunResult:
    eval_loss: float
    curve: list[tuple[int, float]]  # (training tokens processed, held-out nats/byte)
    tokens: int
    bytes_sent_per_learner: float
    bytes_received_per_learner: float
    wall_s: float
    extra: dict = field(default_factory=dict)


class HeldOut:
    """Fixed held-out batches and a model to load parameters into."""

    def __init__(self, cfg: Config, corpus: Corpus) -> None:
        self.batches = eval_batches(corpus.heldout, cfg.eval.num_batches, cfg.eval.batch_size,
                                    cfg.model.ctx_len, seed=EVAL_SEED)
        self.model = build_model(cfg.model, seed=EVAL_SEED)

    def loss(self, params: dict[str, torch.Tensor]) -> float:
        set_params(self.model, params)
        return evaluate(self.model, self.batches)


def tokens_per_phase(cfg: Config) -> int:
    return cfg.inner.steps_per_phase * cfg.data.batch_size * cfg.model.ctx_len


def speeds_of(schedule: str, num_learners: int) -> list[float]:
    """Chunks per tick of each learner on the concurrent clock: the second half 2x slower under -hetero."""
    fast = num_learners - num_learners // 2
    return [1.0 if "hetero" not in schedule or i < fast else 0.5 for i in range(num_learners)]


def active_learners(schedule: str, num_learners: int, round_idx: int) -> list[int]:
    """Which learners finish a phase in this round (the simulated arrival order).

    all: everyone. alternate: even learners on even rounds, odd on odd rounds (two cohorts taking turns:
    one computes a phase while the other waits). hetero: the first half every round, the slower second half
    every other round.
    """
    if schedule == "all" or num_learners == 1:
        return list(range(num_learners))
    if schedule == "alternate":
        return [i for i in range(num_learners) if i % 2 == round_idx % 2]
    if schedule == "hetero":
        fast = num_learners - num_learners // 2
        return [i for i in range(num_learners) if i < fast or round_idx % 2 == 1]
    raise ValueError(f"unknown schedule {schedule!r}")


def quorum_of(schedule: str, num_learners: int) -> int:
    if schedule.startswith("concurrent"):
        return num_learners if "full" in schedule else max(1, num_learners // 2)  # everyone, or a cohort
    return min(len(active_learners(schedule, num_learners, r)) for r in range(2))


def run_dp(cfg: Config, corpus: Corpus, held: HeldOut, steps: int) -> RunResult:
    """One model, batch M x B, an AdamW step every step; ring all-reduce bytes per learner."""
    t0, m = time.time(), cfg.run.num_learners
    model = build_model(cfg.model, seed=cfg.data.seed)
    trainer = InnerTrainer(model, cfg.inner)
    batch = m * cfg.data.batch_size
    sampler = ShardSampler(corpus.train, 0, 1, batch, cfg.model.ctx_len, cfg.data.seed)
    every = cfg.inner.steps_per_phase
    curve = [(0, evaluate(model, held.batches))]
    for s in range(1, steps + 1):
        trainer.train_step(*sampler.next_batch())
        if s % every == 0 or s == steps:
            curve.append((s * batch * cfg.model.ctx_len, evaluate(model, held.batches)))
    num_params = sum(v.numel() for v in get_flat_params(model).values())
    per_learner = steps * allreduce_bytes_per_step(num_params, m)
    return RunResult(curve[-1][1], curve, steps * batch * cfg.model.ctx_len, per_learner, per_learner,
                     time.time() - t0, {"num_params": num_params, "rounds": steps})


def _round(learners: list[Learner], active: list[int]) -> int:
    tokens = 0
    for i in active:
        stats = learners[i].run_phase()
        learners[i].publish(stats)
        tokens += stats.tokens
    for i in active:
        learners[i].publisher.drain()
    return tokens


def _drive(cfg: Config, method: Method, learners: list[Learner], merger: Merger, held: HeldOut,
           target_tokens: int) -> tuple[list[tuple[int, float]], int, list[int]]:
    m, per_phase = len(learners), tokens_per_phase(cfg)
    tokens, r, next_eval = 0, 0, m * per_phase
    curve, merged_per_round = [(0, held.loss(merger.params))], []
    while tokens < target_tokens:
        active = active_learners(method.schedule, m, r)
        active = active[: max(0, (target_tokens - tokens) // per_phase)]
        if not active:
            break
        tokens += _round(learners, active)
        manifest = merger.merge_once()
        if manifest is None:
            raise RuntimeError(f"{method.name}: merge {r} committed nothing")
        merged_per_round.append(len(manifest.merged()))
        if method.mode == "sync":
            for learner in learners:
                if manifest.version > learner.state.base:
                    learner.install(manifest.version)
        if tokens >= next_eval or tokens >= target_tokens:
            curve.append((tokens, held.loss(merger.params)))
            next_eval += m * per_phase
        r += 1
    return curve, tokens, merged_per_round


def _drive_clock(cfg: Config, method: Method, learners: list[Learner], merger: Merger, held: HeldOut,
                 target_tokens: int) -> tuple[list[tuple[int, float]], int, list[int]]:
    from diloco.bench._concurrent import clocked, drive_concurrent

    m, h, tick = len(learners), cfg.inner.steps_per_phase, cfg.learner.probe_every_steps
    speeds = speeds_of(method.schedule, m)
    # DyLU: the engine's rule (inner.dylu), rounded down to whole ticks
    hs = [phase_steps(h, s, max(speeds), tick) // tick * tick if method.dylu else h for s in speeds]
    curve, every = [(0, held.loss(merger.params))], m * tokens_per_phase(cfg)
    state = {"next": every}

    def on_tokens(tokens: int) -> None:
        if tokens >= state["next"] or tokens >= target_tokens:
            point = (tokens, held.loss(merger.params))
            if curve[-1][0] == tokens:
                curve[-1] = point  # the leftovers merged at the end: the same tokens, a newer version
            else:
                curve.append(point)
            state["next"] = (tokens // every + 1) * every

    clocks = clocked(learners, speeds, hs, tick, stagger="full" not in method.schedule)
    tokens, merged = drive_concurrent(clocks, merger, tick,
                                      cfg.data.batch_size * cfg.model.ctx_len, target_tokens,
                                      quorum_of(method.schedule, m), on_tokens)
    return curve, tokens, merged


def run_engine(cfg: Config, method: Method, corpus: Corpus, held: HeldOut, steps: int) -> RunResult:
    """Learners and merger in this process on a file:// store; each round: phases, publish, merge."""
    t0, m = time.time(), cfg.run.num_learners
    concurrent = method.schedule.startswith("concurrent")
    cfg = cfg.with_overrides({
        "learner.codec": method.codec, "learner.mode": method.mode,
        "learner.local_state_every_steps": 0,  # no restarts here: no state files on this host (not traffic)
        # the probe fetches: deterministic (a prefetch is a tick late on the clock)
        "learner.prefetch": False,
        "learner.device": "cpu", "merger.grace_cap_s": 0.0,
        # on the clock the bench decides when a quorum is there; the merger takes what is pending
        "merger.quorum": 1 if concurrent else quorum_of(method.schedule, m), **dict(method.overrides),
    })
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        store = open_store(f"file://{tmp}")
        ctx = create_run(store, f"q-{method.name}-s{cfg.data.seed}", cfg)
        counters = [CountingStore(store) for _ in ctx.learners]
        learners = [Learner(replace(ctx, store=c), n, make_spec(ctx.cfg, corpus))
                    for c, n in zip(counters, ctx.learners, strict=True)]
        for learner, counter in zip(learners, counters, strict=True):
            learner.join()
            counter.reset()  # the initial download is not per-step traffic (DP has it too)
        merger = Merger(ctx)
        merger.load()
        target = m * steps * cfg.data.batch_size * cfg.model.ctx_len
        drive = _drive_clock if concurrent else _drive
        curve, tokens, merged = drive(cfg, method, learners, merger, held, target)
        for learner in learners:
            learner.close()
        versions = merger.version
        from diloco.trust.outliers import guard_figures

        # the outlier rule over honest deltas: 0 rejections expected (docs/ENGINE.md)
        guard = guard_figures(ctx)
    sent, received, extra = traffic_of(counters)
    extra.update({"versions": versions, "deltas_merged": sum(merged), "guard": guard})
    return RunResult(curve[-1][1], curve, tokens, sum(sent) / m, sum(received) / m, time.time() - t0, extra)


def traffic_of(counters: list[CountingStore]) -> tuple[list[int], list[int], dict[str, Any]]:
    """Every byte each learner sent and received (deltas, checkpoints, statuses, manifests, updates, listings:
    all a CountingStore counts), and the extra fields beside: per learner, by kind, the deltas alone."""
    m = max(1, len(counters))
    sent = [sum(c.sent.values()) for c in counters]
    received = [sum(c.received.values()) for c in counters]
    by_kind = [{"sent": dict(c.sent), "received": dict(c.received)} for c in counters]
    return sent, received, {
        "sent_per_learner": sent, "received_per_learner": received, "traffic_by_kind": by_kind,
        "delta_bytes_sent_per_learner": sum(c.sent["delta"] for c in counters) / m,
        "global_bytes_received_per_learner": sum(c.received["global"] for c in counters) / m,
        "manifest_bytes_read_per_learner": sum(c.received["manifest"] for c in counters) / m}


def run_method(cfg: Config, method: Method, corpus: Corpus, held: HeldOut, steps: int,
               seed: int) -> RunResult:
    cfg = cfg.with_overrides({"data.seed": seed, "inner.total_steps": steps})
    torch.manual_seed(seed)
    if method.kind == "dp":
        return run_dp(cfg, corpus, held, steps)
    if method.kind == "peer":
        return run_peer(cfg, method, steps, seed)
    if method.kind == "streaming":
        from diloco.bench._streaming import run_streaming

        return run_streaming(cfg, method, corpus, held, steps)
    return run_engine(cfg, method, corpus, held, steps)


def run_peer(cfg: Config, method: Method, steps: int, seed: int) -> RunResult:
    """torchft's DiLoCo on the same model, shards and tokens (diloco.bench.peer_torchft); bytes: a ring
    all-reduce of the payload its replicas handed to gloo (counted), each way."""
    from diloco.bench.peer_torchft import run_torchft

    fragments = method.fragments
    run = run_torchft(cfg, steps, seed, fragments=fragments, sync_delay=1 if fragments > 1 else 0,
                      alpha=0.5 if fragments > 1 else 0.0)
    per_step = cfg.run.num_learners * cfg.data.batch_size * cfg.model.ctx_len
    curve = [(s * per_step, loss) for s, loss in run["curve"]]
    extra = {k: v for k, v in run.items() if k not in ("curve", "final_loss")}
    return RunResult(run["final_loss"], curve, steps * per_step, run["bytes_per_learner_ring_model"],
                     run["bytes_per_learner_ring_model"], run["wall_s"], extra)

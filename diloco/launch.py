"""Build each role of a run from (storage URL, run id, name): what a process or a flow starts with.

Contract: the config comes from run.json in the bucket, never from the caller, so every process
of a run agrees on it; a run with a chaos control object gets its faults here (diloco.chaos).
A warm standby (`wait_as_standby`) pays the imports first and reads nothing from the bucket until started.
"""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from diloco.chaos.inprocess import MergerSaboteur, apply_chaos
from diloco.configs import InnerConfig, ModelConfig
from diloco.run.corpus import load_run_corpus
from diloco.run.events import EventLog
from diloco.learner.learner import Learner
from diloco.run.loops import Evaluator, StopSignal
from diloco.merger.merger import Merger
from diloco.run.context import RunContext, open_run
from diloco.storage.keys import validate_learner_name
from diloco.training.inner import InnerTrainer
from diloco.training.model import build_model


def make_learner(storage: str, run_id: str, name: str) -> tuple[Learner, StopSignal]:
    validate_learner_name(name)
    # torch's lazy imports (~3 s: the optimizer's first step pulls torch._dynamo) belong to the start,
    # before the join, not to the first phase's time (goodput counts phase time as compute); a warm
    # standby has paid them already and this is then a few milliseconds
    warm_up(prefect=False)
    ctx = open_run(storage, run_id)
    control = apply_chaos(ctx)
    slowdown = control.slowdown.get(name) if control else None
    # events are kept and flushed again on failure: one quick retry, so an outage does not stall each phase
    events = EventLog(ctx.store.with_retries(1), ctx.keys, name)
    learner = Learner(ctx, name, load_run_corpus(ctx.cfg.data), events=events,
                      slowdown=slowdown)
    return learner, StopSignal(ctx, ctx.cfg.run.num_versions)


def make_merger(storage: str, run_id: str, merger_id: str = "merger") -> tuple[Merger, RunContext]:
    ctx = open_run(storage, run_id)
    raw_store = ctx.store
    control = apply_chaos(ctx)
    events = EventLog(ctx.store, ctx.keys, merger_id)
    hook = MergerSaboteur(ctx, raw_store, merger_id, events) if control else None
    return Merger(ctx, merger_id, events=events, stage_hook=hook), ctx


def make_evaluator(storage: str, run_id: str) -> tuple[Evaluator, StopSignal]:
    ctx = open_run(storage, run_id)
    apply_chaos(ctx)
    evaluator = Evaluator(ctx, load_run_corpus(ctx.cfg.data), events=EventLog(ctx.store, ctx.keys, "evaluator"))
    return evaluator, StopSignal(ctx, ctx.cfg.run.num_versions)


_torch_warm = False  # the throwaway step ran in this process (a zygote's forks inherit it)


def warm_up(prefect: bool) -> None:
    """Pay, without the bucket, what a learner process pays before it can join: torch's lazy imports
    (the optimizer's first step pulls torch._dynamo) on a throwaway model; prefect and the flow module.
    Once per process: again (a warm standby's or a forked learner's make_learner) it costs nothing."""
    global _torch_warm
    if not _torch_warm:
        cfg = ModelConfig(n_layer=1, n_head=1, d_model=8, ctx_len=4)
        trainer = InnerTrainer(build_model(cfg), InnerConfig())
        tokens = torch.zeros(1, cfg.ctx_len, dtype=torch.long)
        trainer.train_step(tokens, tokens)
        _torch_warm = True
    if prefect:
        import prefect  # noqa: F401

        import diloco.flows.learner  # noqa: F401


def wait_as_standby(prefect: bool, stdin: TextIO = sys.stdin) -> bool:
    """Warm up, then block until a line arrives on stdin: True to start now, False at end of input
    (the supervisor is gone or stopped this spare)."""
    warm_up(prefect)
    print("standby ready", file=sys.stderr, flush=True)
    return bool(stdin.readline())

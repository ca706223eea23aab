"""Build each role of a run from (storage URL, run id, name): what a process or a flow starts with.

Contract: the config comes from run.json in the bucket, never from the caller, so every process
of a run agrees on it; a run with a chaos control object gets its faults here (diloco.chaos).
"""

from __future__ import annotations

from diloco.chaos.inprocess import MergerSaboteur, apply_chaos
from diloco.engine.corpus import load_run_corpus
from diloco.engine.events import EventLog
from diloco.engine.learner import Learner
from diloco.engine.loops import Evaluator, StopSignal
from diloco.engine.merger import Merger
from diloco.engine.run import RunContext, open_run
from diloco.storage.keys import validate_learner_name


def make_learner(storage: str, run_id: str, name: str) -> tuple[Learner, StopSignal]:
    validate_learner_name(name)
    ctx = open_run(storage, run_id)
    control = apply_chaos(ctx)
    slowdown = control.slowdown.get(name) if control else None
    learner = Learner(ctx, name, load_run_corpus(ctx.cfg.data), events=EventLog(ctx.store, ctx.keys, name),
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

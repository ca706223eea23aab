"""The learner's model and trainer on one rank, rank 0's side of every step, and the other ranks' loop
(diloco.learner.world holds the process group and its collectives; diloco.launch starts the world).

Contract: every rank builds the same model (the spec under the run's seed, the run's layout checked), the
same optimizer and the same DDP wrapper; rank 0 is the Learner and the only rank that touches the bucket;
`follow` mirrors rank 0 step for step and never opens the run's store.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from diloco.learner.world import CLOCK, FULL, PARAMS, RESET, STOP, World, slice_batch
from diloco.run.spec import build_model, check_layout, load_run_spec
from diloco.training.data import shard_of
from diloco.training.inner import InnerTrainer
from diloco.training.spec import SpecError, TrainSpec

if TYPE_CHECKING:
    from diloco.learner.learner import Learner
    from diloco.run.context import RunContext

log = logging.getLogger("diloco.learner")


def _optimizer(spec: TrainSpec, model: nn.Module) -> torch.optim.Optimizer | None:
    if spec.build_optimizer is None:
        return None  # the engine's AdamW from inner.*
    try:
        opt = spec.build_optimizer(list(model.parameters()))
    except Exception as err:  # noqa: BLE001 - user code: one line naming it
        raise SpecError(f"build_optimizer failed: {type(err).__name__}: {err}") from err
    if not isinstance(opt, torch.optim.Optimizer):
        raise SpecError(f"build_optimizer returned a {type(opt).__name__}, not a torch.optim.Optimizer")
    return opt


def make_trainer(ctx: RunContext, spec: TrainSpec, device: str, who: str,
                 world: World | None) -> tuple[nn.Module, InnerTrainer]:
    """(model, trainer) of one rank: the spec's model on `device`, checked; DDP-wrapped in a multi-rank
    world."""
    model = build_model(spec, ctx.cfg.data.seed).to(device)
    check_layout(ctx, model, who)
    forward, reduce = None, None
    if world is not None and world.size > 1:
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(model,
                                          device_ids=[torch.device(device).index] if device.startswith("cuda")
                                          else None)
        reduce = world.reduce_step
    trainer = InnerTrainer(model, ctx.cfg.inner, device=device, optimizer=_optimizer(spec, model),
                           lr_at_step=spec.lr_at, loss=spec.loss, forward_model=forward, reduce=reduce)
    return model, trainer


def _sync(world: World, word: int, model: nn.Module, trainer: InnerTrainer, cursor: int | None) -> int | None:
    """The broadcasts a control word announces (both sides call it); returns the cursor when FULL."""
    if word & (FULL | PARAMS):
        world.params(model)
    if word & FULL:
        tensors, meta = trainer.export_state() if world.leader else (None, None)
        tensors = world.tensors(tensors)
        meta = world.json(meta)
        cursor = world.json(cursor)
        if not world.leader:
            trainer.import_state(tensors, meta)
    if word & RESET and not world.leader:
        trainer.reset_optimizer()
    if word & (FULL | PARAMS | CLOCK) and trainer.cfg.schedule_clock == "run":
        # rank 0's schedule moved: every rank's lr follows
        trainer.set_clock(world.json(trainer.schedule_step))
    return cursor


def lead_step(learner: Learner) -> None:
    """Rank 0, before each inner step: the control word, and what it announces."""
    world = learner.world
    word = world.control()
    _sync(world, word, learner.model, learner.trainer, learner.cursor)


def follow(world: World, ctx: RunContext, name: str, spec: TrainSpec | None = None) -> int:
    """A rank other than 0: mirror rank 0 until it says stop; returns the steps taken."""
    spec = spec or load_run_spec(ctx)
    device = world.device if world.device.startswith("cuda") else "cpu"
    model, trainer = make_trainer(ctx, spec, device, f"learner {name} rank {world.rank}", world)
    shard, num_shards = shard_of(name, ctx.learners)
    batches, steps = None, 0
    while True:
        word = world.control()
        if word & STOP:
            return steps
        cursor = _sync(world, word, model, trainer, None)
        if cursor is not None:
            batches = iter(spec.batches(shard, num_shards, cursor))
        if batches is None:
            raise RuntimeError(f"learner {name} rank {world.rank}: a step before rank 0's join")
        # a non-finite loss: every rank saw it (reduce_step); rank 0 abandons the phase and sends fresh
        # parameters
        with contextlib.suppress(FloatingPointError):
            trainer.train_step(slice_batch(next(batches), world.rank, world.size))
        steps += 1


def ranks_of(ctx: RunContext, name: str) -> int:
    """The learner's rank count: learner.ranks, or its entry in learner.ranks_per_learner."""
    return ctx.cfg.learner.ranks_per_learner.get(name, ctx.cfg.learner.ranks)

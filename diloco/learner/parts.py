"""What a learner is wired from, built once: its run and name, its model and trainer, its lanes, its threads
(publisher, courier, local-state writer, encoder) and its pace.

Contract: `wire` builds every part from the run's config and nothing else (the run's context, the learner's
name, its spec, its events, its process group, its signing key); the lanes are one per fragment chain, or for
the whole model (fragments.count = 1) one lane holding every tensor whole, on the root chain, with no overlap
wait. Wiring reads nothing from the bucket: the join does (diloco.learner.resume).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from diloco.configs import Config
from diloco.learner.checkpoint import Checkpointer
from diloco.learner.courier import Courier
from diloco.learner.lanes import Lanes
from diloco.learner.local_state import LocalState
from diloco.learner.pace import Pace
from diloco.learner.publisher import Publisher
from diloco.learner.ranks import make_trainer
from diloco.learner.slots import Slots
from diloco.learner.state import QUICK_RETRIES
from diloco.learner.world import World
from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.run.heap import map_large_blocks, status_bytes
from diloco.run.spec import load_run_spec
from diloco.storage.store import Store
from diloco.training.fragments import plan_fragments
from diloco.training.inner import InnerTrainer, pick_device
from diloco.training.spec import TrainSpec, model_layout
from diloco.trust.signing import learner_key


@dataclass
class LearnerParts:
    """A learner's collaborators (the Learner takes each as an attribute of the same name)."""

    ctx: RunContext
    name: str
    cfg: Config
    spec: TrainSpec
    device: str  # where it trains: "cpu" or "cuda[:i]" (learner.device)
    events: EventLog
    signing_key: bytes | None  # learner.sign: signs every delta (trust/signing.py; never from the bucket)
    world: World | None  # a multi-rank learner's process group (this is rank 0); None: one process
    model: nn.Module
    trainer: InnerTrainer
    lanes: Lanes  # one per chain: ship and carry (diloco.learner.lanes)
    local: LocalState | None  # learner.local_state_every_steps > 0: its state on this host
    quick: Store  # the store with one quick retry: probes and heartbeats on the training thread
    courier: Courier  # statuses and event flushes, off the training thread
    pace: Pace  # its compute speed (every status reports it) and, with inner.dylu, its H from its peers'
    publisher: Publisher  # uploads in seq order, off the training thread
    encoder: ThreadPoolExecutor | None  # learner.encode_in_background (fragments): deltas encoded off-thread
    checkpointer: Checkpointer  # the bucket checkpoint's cadence and encoder (learner.checkpoint_every)
    baseline_rss_bytes: int | None  # the process's resident memory before the model was built (its imports)


def wire(ctx: RunContext, name: str, spec: TrainSpec | None = None, *, events: EventLog | None = None,
         world: World | None = None, signing_key: bytes | None = None) -> LearnerParts:
    """Every part of learner `name` (its spec: the run's unless given; its model checked against the run's
    layout)."""
    cfg = ctx.cfg
    key = signing_key or (learner_key() if cfg.learner.sign else None)
    device = pick_device(cfg.learner.device)
    torch.set_num_threads(cfg.learner.num_threads)  # one failure domain, one core by default
    map_large_blocks()  # freed gradients and temporaries go back to the OS (diloco.run.heap)
    if device.startswith("cuda"):  # the CUDA runtime's host memory is the process's, not the model's
        torch.zeros(1, device=device)
    baseline = status_bytes("VmRSS")
    spec = spec or load_run_spec(ctx)
    events = events or EventLog(None, None, name)
    local = LocalState(ctx.store.url, ctx.run_id, name, ctx.created_at, ctx.fingerprint) \
        if cfg.learner.local_state_every_steps > 0 else None
    quick = ctx.store.with_retries(QUICK_RETRIES)
    h = cfg.inner.steps_per_phase
    pace = Pace(quick, ctx.keys, name, list(ctx.learners), h, enabled=cfg.inner.dylu,
                timeout_s=cfg.run.heartbeat_timeout_s)
    slots = Slots(ctx.store, ctx.run_id, ctx.keys, name, key)
    publisher = Publisher(ctx.store, events, slots, on_landed=local.unspool if local else None)
    model, trainer = make_trainer(ctx, spec, device, f"learner {name}", world)
    # G (and on a CPU learner r) spilled to this host's disk: the local state's directory, which names the
    # files (without local state, Lanes' scratch space)
    spill = local.spill if local is not None else None
    if ctx.fragments:
        tau = cfg.fragments.overlap_steps
        lanes = Lanes(ctx.fragments, h, tau, cfg.learner.mode, spill)
        # inner.dylu: H_w leaves every fragment its own ship and its overlap in a cycle
        pace.min_steps = max(tau + 1, cfg.fragments.count, cfg.fragments.cohorts)
    else:  # the whole model: one lane of every tensor whole, in the order a delta carries them
        lanes = Lanes(plan_fragments(model_layout(model), 1), h, 0, cfg.learner.mode, spill)
    background = cfg.learner.encode_in_background
    encoder = ThreadPoolExecutor(1, thread_name_prefix=f"encode-{name}") if ctx.fragments and (
        background is True or (background == "auto" and device.startswith("cuda"))) else None
    return LearnerParts(ctx=ctx, name=name, cfg=cfg, spec=spec, device=device, events=events, signing_key=key,
                        world=world, model=model, trainer=trainer, lanes=lanes, local=local, quick=quick,
                        courier=Courier(f"courier-{name}"), pace=pace, publisher=publisher, encoder=encoder,
                        checkpointer=Checkpointer(ctx.keys, name, ctx.fingerprint,
                                                  cfg.learner.checkpoint_every,
                                                  cfg.learner.checkpoint_moments),
                        baseline_rss_bytes=baseline)

"""One resume path for a (re)starting learner, trying its sources in order: this host's local state, then
the newest committed version with the bucket checkpoint's optimizer state and data cursor, then fresh.

Contract: the local state is used when the bucket has not moved past it (no seq of ours listed or decided
beyond it; without the bucket — an outage — it is trusted, the publisher's exclusive create still fences a
duplicate) and when it fits the model; its spooled deltas not yet in the bucket are queued again. Anything
unusable is dropped (logged, and for a checkpoint recorded as an event), never trusted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco.learner.local_state import LocalState, Saved
from diloco.learner.state import QUICK_RETRIES, LearnerState
from diloco.run.buffers import read_buffers
from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.run.objects import read_committed, read_tensors
from diloco.storage import Manifest, NotFound, StorageError, Store, read_latest
from diloco.storage.codec import CodecError
from diloco.storage.keys import parse_delta_key
from diloco.training.tensors import Tensors, clone

log = logging.getLogger("diloco.learner")

SetTheta = Callable[[Tensors], None]  # load parameters into the model (ValueError when they do not fit)
ImportOptimizer = Callable[[Tensors, dict], int]  # load optimizer state, return its step (ValueError: no fit)


@dataclass
class Resumed:
    state: LearnerState
    cursor: int  # batches of the shard already consumed
    step: int  # the optimizer's step count (drives the schedule)
    extra: dict = field(default_factory=dict)  # for the join event: where it came from
    tokens_total: int | None = None  # of the newest manifest read on the way (the run's clock); None: none read


def next_seq(ctx: RunContext, name: str, manifest: Manifest | None, store: Store | None = None) -> int:
    """One past the highest seq of ours listed in the bucket (through `store`, default the run's) or decided
    by `manifest`."""
    listed = [parse_delta_key(k) for k in (store or ctx.store).list(ctx.keys.deltas_prefix(name))]
    seqs = [p[1] for p in listed if p and p[0] == name]
    return max([*seqs, manifest.cursors.get(name, -1) if manifest else -1]) + 1


def resume(ctx: RunContext, name: str, *, local: LocalState | None, events: EventLog, set_theta: SetTheta,
           import_optimizer: ImportOptimizer, requeue: Callable[[int, bytes], None],
           use_checkpoint: bool = True, set_buffers: SetTheta | None = None) -> Resumed:
    """Where the learner continues from; its model and optimizer are set on the way, and (`set_buffers`) the
    buffers the run merges: the local state's own, or the version's from the bucket."""
    saved = local.load() if local is not None else None
    if saved is not None:
        resumed = _from_local(ctx, name, saved, local, set_theta, import_optimizer, requeue, set_buffers)
        if resumed is not None:
            return resumed
    manifest = read_latest(ctx.store, ctx.keys)
    if manifest is None:
        raise RuntimeError(f"run {ctx.run_id} has no committed version")
    _, params = read_committed(ctx.store, manifest.params_key, fingerprint=ctx.fingerprint,
                               checksum=manifest.params_checksum, what=f"version {manifest.version}'s params")
    state = LearnerState.at_version(manifest.version, params, next_seq(ctx, name, manifest),
                                    manifest.cursors.get(name, -1))
    set_theta(clone(params))
    if set_buffers is not None and (buffers := read_buffers(ctx, manifest)) is not None:
        set_buffers(buffers)
    step, cursor = _from_checkpoint(ctx, name, events, import_optimizer) if use_checkpoint else (0, 0)
    return Resumed(state, cursor, step, tokens_total=manifest.tokens_total)


def _from_local(ctx: RunContext, name: str, saved: Saved, local: LocalState, set_theta: SetTheta,
                import_optimizer: ImportOptimizer, requeue: Callable[[int, bytes], None],
                set_buffers: SetTheta | None = None) -> Resumed | None:
    """The local state, or None (and the state cleared) when the bucket moved past it or it does not fit."""
    meta = saved.meta
    quick = ctx.store.with_retries(QUICK_RETRIES)  # in an outage: resume at once, not after the retry budget
    try:
        latest = read_latest(quick, ctx.keys)
        bucket_next: int | None = next_seq(ctx, name, latest, quick)
    except StorageError as err:
        log.warning("learner %s: bucket unreachable (%s); resuming from local state unchecked", name, err)
        latest, bucket_next = None, None
    try:
        state = LearnerState.from_saved(meta, saved.parts["glob"], saved.parts["ref"])
        if bucket_next is not None and bucket_next > state.seq:
            log.info("learner %s: local state (next seq %d) is behind the bucket (%d); dropped",
                     name, state.seq, bucket_next)
            local.clear()
            return None
        cursor = int(meta["cursor"])
        set_theta(saved.parts["theta"])  # first: a failed optimizer import below leaves the optimizer fresh
        if set_buffers is not None and saved.parts.get("buffers"):  # its own running statistics (a save of a run
            set_buffers(saved.parts["buffers"])  # without buffers has none)
        step = import_optimizer(saved.parts["opt"], meta.get("optimizer") or {})
    except (ValueError, KeyError, RuntimeError) as err:
        log.warning("learner %s: local state does not fit (%s); dropped", name, err)
        local.clear()
        return None
    requeued = []
    for seq, data in local.spooled():
        if seq >= state.seq:  # written just before a crash that the state does not include: redone
            local.discard(seq)
        elif bucket_next is None or seq >= bucket_next:
            requeue(seq, data)
            requeued.append(seq)
        else:
            local.discard(seq)  # listed or decided already
    return Resumed(state, cursor, step, {"local": True, "requeued": requeued,
                                         "unshipped_steps": state.steps_since_publish},
                   tokens_total=latest.tokens_total if latest is not None else None)


def _from_checkpoint(ctx: RunContext, name: str, events: EventLog,
                     import_optimizer: ImportOptimizer) -> tuple[int, int]:
    """(optimizer step, data cursor) from the bucket checkpoint; (0, 0) and a fresh optimizer without one."""
    try:
        header, state = read_tensors(ctx.store, ctx.keys.checkpoint(name, "state"))
    except NotFound:
        return 0, 0
    except (CodecError, StorageError) as err:
        log.warning("learner %s: checkpoint unreadable (%s); starting fresh state", name, err)
        events.emit("checkpoint_unreadable", learner=name, reason=str(err))
        return 0, 0
    meta = header.meta
    try:
        step = import_optimizer(state, meta.get("optimizer") or {})
    except ValueError as err:
        log.warning("learner %s: checkpoint does not fit (%s); starting fresh state", name, err)
        events.emit("checkpoint_unreadable", learner=name, reason=str(err))
        return 0, 0
    events.emit("resume", learner=name, step=meta.get("step"), cursor=meta.get("cursor"), checkpoint_seq=meta.get("seq"))
    return step, int(meta.get("cursor", 0))

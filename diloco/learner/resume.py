"""One resume path for a (re)starting learner, trying its sources in order: this host's local state, then
the newest committed version of every chain (the root's; with fragments every fragment's) with the bucket
checkpoint's optimizer state and data cursor, then fresh.

Contract: the local state is used when the bucket has not moved past it (no seq of ours listed or decided
beyond it on any chain; without the bucket — an outage — it is trusted, the publisher's exclusive create still
fences a duplicate) and when it fits the model and the run's chains; its spooled deltas not yet in the bucket
are queued again, and so are those whose slot holds another object (the publisher ships them on:
diloco.learner.slots). From the bucket, a fragmented learner's data cursor and inner step are at least its
last status's (its lanes shipped steps past the checkpoint, which follows fragment 0's delta). Anything
unusable is dropped (logged, and for a checkpoint recorded as an event), never trusted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from diloco.learner.checkpoint import read_checkpoint
from diloco.learner.local_state import LocalState, Saved
from diloco.learner.state import QUICK_RETRIES, LearnerState
from diloco.run.buffers import read_buffers
from diloco.run.chain_state import ADD_WORKERS, chain_params
from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.run.fragments import fragment_context, num_fragments
from diloco.storage import Manifest, NotFound, StorageError, Store, read_latest
from diloco.storage.codec import CodecError
from diloco.storage.keys import parse_delta_key
from diloco.storage.records import LearnerStatus, RecordError, read_record
from diloco.training.fragments import put_
from diloco.training.tensors import Tensors

log = logging.getLogger("diloco.learner")

SetTheta = Callable[[Tensors], None]  # load parameters into the model (ValueError when they do not fit)
ImportOptimizer = Callable[[Tensors, dict], int]  # load optimizer state, return its step (ValueError: no fit)
Requeue = Callable[[int, bytes, int], None]  # (seq, bytes, lane): a spooled delta of a chain, uploaded again


@dataclass
class Resumed:
    lanes: list[LearnerState]  # per chain, in fragment order (the whole model: one)
    cursor: int  # batches of the shard already consumed
    step: int  # the optimizer's step count (drives the schedule)
    extra: dict = field(default_factory=dict)  # for the join event: where it came from
    tokens_total: int | None = None  # of the newest manifest read on the way (the run's clock); None: none
    schedule: dict | None = None  # a fragmented learner's lane schedule, as its local state kept it

    @property
    def state(self) -> LearnerState:
        """The first chain's state: the whole model's in a run without fragments."""
        return self.lanes[0]


def chains(ctx: RunContext) -> list[RunContext]:
    """The run's chains, one per lane: the root (the whole model), or every fragment's."""
    return [fragment_context(ctx, index) for index in range(num_fragments(ctx))]


def next_seq(ctx: RunContext, name: str, manifest: Manifest | None, store: Store | None = None) -> int:
    """One past the highest seq of ours listed in the chain of `ctx` (through `store`, default the run's) or
    decided by `manifest`."""
    listed = [parse_delta_key(k) for k in (store or ctx.store).list(ctx.keys.deltas_prefix(name))]
    seqs = [p[1] for p in listed if p and p[0] == name]
    return max([*seqs, manifest.cursors.get(name, -1) if manifest else -1]) + 1


def read_params(ctx: RunContext, index: int, manifest: Manifest, add_workers: int = ADD_WORKERS) -> Tensors:
    """Chain `index`'s committed parameters at `manifest`, the newest version: the chain's newest checkpoint
    and the updates after it (diloco.run.chain_state; CorruptObject names an object that fails its checks)."""
    return chain_params(fragment_context(ctx, index), manifest, newest=True, add_workers=add_workers)


# chains a rejoin reads at once (each a checkpoint and its updates: I/O, hashing, decoding), each adding its
# updates on its own thread: at 124M, P = 24, a second thread per add (a thread pool per tensor and update)
# made the rejoin 1.56 -> 1.88 s (docs/bench/scale.md)
CHAIN_READERS = 2


def read_newest(ctx: RunContext) -> list[tuple[Manifest, Tensors]]:
    """(newest manifest, committed params) of every chain, in chain order: chain_params of each, CHAIN_READERS
    chains at a time (a fragmented run's rejoin reads P of them; the bits do not depend on the order)."""
    links = chains(ctx)
    count = len(links)

    def one(index: int) -> tuple[Manifest, Tensors]:
        manifest = read_latest(ctx.store, links[index].keys)
        if manifest is None:
            raise RuntimeError(f"run {ctx.run_id} has no committed version")
        return manifest, read_params(ctx, index, manifest, add_workers=ADD_WORKERS if count == 1 else 1)

    if count == 1:
        return [one(0)]
    with ThreadPoolExecutor(max_workers=CHAIN_READERS, thread_name_prefix="rejoin") as pool:
        return list(pool.map(one, range(count)))


def resume(ctx: RunContext, name: str, *, local: LocalState | None, events: EventLog, set_theta: SetTheta,
           import_optimizer: ImportOptimizer, requeue: Requeue, use_checkpoint: bool = True,
           set_buffers: SetTheta | None = None) -> Resumed:
    """Where the learner continues from; its model and optimizer are set on the way, and (`set_buffers`) the
    buffers the run merges: the local state's own, or the version's from the bucket (fragment 0's)."""
    saved = local.load() if local is not None else None
    if saved is not None:
        resumed = _from_local(ctx, name, saved, local, set_theta, import_optimizer, requeue, set_buffers)
        if resumed is not None:
            return resumed
    states, globs, newest = [], [], []
    for chain, (manifest, params) in zip(chains(ctx), read_newest(ctx), strict=True):
        states.append(LearnerState.at_version(manifest.version, params, next_seq(chain, name, manifest),
                                              manifest.cursors.get(name, -1)))
        globs.append(params)
        newest.append(manifest)
    set_theta(_whole(ctx, globs))
    if set_buffers is not None and (buffers := read_buffers(ctx, newest[0])) is not None:
        set_buffers(buffers)
    step, cursor = _from_checkpoint(ctx, name, events, import_optimizer) if use_checkpoint else (0, 0)
    if ctx.fragments:
        cursor, step = _last_position(ctx, name, cursor, step)
    return Resumed(states, cursor, step, tokens_total=max(m.tokens_total for m in newest))


def _whole(ctx: RunContext, globs: list[Tensors]) -> Tensors:
    """The whole model's parameters from every chain's: the root's itself (set_theta copies them into the
    model), or the fragments' together."""
    if not ctx.fragments:
        return globs[0]
    theta = {e["name"]: torch.zeros(e["shape"], dtype=torch.float32) for e in ctx.layout}
    for fragment, glob in zip(ctx.fragments, globs, strict=True):
        put_(theta, fragment, glob)
    return theta


def saved_lanes(ctx: RunContext, saved: Saved) -> list[LearnerState]:
    """Every chain's state in a local state: the whole model's at the top level of its meta, a fragmented
    learner's in `lanes` (each with its fragment's pieces of `ref` and `glob`). ValueError/KeyError when it is
    not the run's shape."""
    meta, parts = saved.meta, saved.parts
    lanes = meta.get("lanes")
    if not ctx.fragments:
        if lanes is not None:
            raise ValueError("a fragmented learner's state, and the run has no fragments")
        return [LearnerState.from_saved(meta, parts["glob"], parts["ref"])]
    if not isinstance(lanes, list) or len(lanes) != len(ctx.fragments):
        count = len(lanes) if isinstance(lanes, list) else 1
        raise ValueError(f"a state of {count} chain(s), and the run has {len(ctx.fragments)} fragments")
    out = []
    for lane, fragment in zip(lanes, ctx.fragments, strict=True):
        keys = [piece["key"] for piece in fragment["pieces"]]
        out.append(LearnerState.from_saved(lane, {k: parts["glob"][k] for k in keys},
                                           {k: parts["ref"][k] for k in keys}))
    return out


def _from_local(ctx: RunContext, name: str, saved: Saved, local: LocalState, set_theta: SetTheta,
                import_optimizer: ImportOptimizer, requeue: Requeue,
                set_buffers: SetTheta | None = None) -> Resumed | None:
    """The local state, or None (and the state cleared) when the bucket moved past it or it does not fit."""
    meta, links = saved.meta, chains(ctx)
    quick = ctx.store.with_retries(QUICK_RETRIES)  # in an outage: resume at once, not after the retry budget
    try:
        latest = [read_latest(quick, chain.keys) for chain in links]
        bucket_next: list[int] | None = [next_seq(chain, name, m, quick) for chain, m in zip(links, latest,
                                                                                             strict=True)]
    except StorageError as err:
        log.warning("learner %s: bucket unreachable (%s); resuming from local state unchecked", name, err)
        latest, bucket_next = None, None
    try:
        states = saved_lanes(ctx, saved)
        behind = [(s.seq, b) for s, b in zip(states, bucket_next or [], strict=False) if b > s.seq]
        if behind:
            log.info("learner %s: local state (next seq %d) is behind the bucket (%d); dropped", name,
                     *behind[0])
            local.clear()
            return None
        cursor = int(meta["cursor"])
        set_theta(saved.parts["theta"])  # first: a failed optimizer import below leaves the optimizer fresh
        if set_buffers is not None and saved.parts.get("buffers"):  # its own running statistics (a save of
            set_buffers(saved.parts["buffers"])  # a run without buffers has none)
        step = import_optimizer(saved.parts["opt"], meta.get("optimizer") or {})
    except (ValueError, KeyError, RuntimeError) as err:
        log.warning("learner %s: local state does not fit (%s); dropped", name, err)
        local.clear()
        return None
    requeued: list = []
    for index, chain in enumerate(links):
        fragment = chain.keys.fragment
        for seq, data in local.spooled(fragment):
            if seq >= states[index].seq:  # written just before a crash the state does not include: redone
                local.discard(seq, fragment)
            elif bucket_next is None or seq >= bucket_next[index] or _taken(quick, chain, name, seq, data):
                requeue(seq, data, index)  # its slot held by another object: the publisher ships it on
                requeued.append(seq if fragment is None else [index, seq])
            else:
                local.discard(seq, fragment)  # listed or decided already
    unshipped = max(s.steps_since_publish for s in states)
    return Resumed(states, cursor, step, {"local": True, "requeued": requeued, "unshipped_steps": unshipped},
                   tokens_total=max(m.tokens_total for m in latest) if latest is not None else None,
                   schedule=meta.get("schedule") if ctx.fragments else None)


def _taken(store: Store, chain: RunContext, name: str, seq: int, data: bytes) -> bool:
    """Whether spooled delta `seq`'s slot holds an object other than these bytes (planted; the publisher finds
    where it landed, or ships it at the next free seq), not nothing (decided lost, or retired). Unknown (the
    bucket away): True, the publisher looks again."""
    key = chain.keys.delta(name, seq)
    try:
        return store.get_size(key) != len(data) or store.get(key) != data
    except NotFound:
        return False
    except StorageError:
        return True


def _last_position(ctx: RunContext, name: str, cursor: int, step: int) -> tuple[int, int]:
    """(data cursor, inner step), at least those of the learner's last status: its lanes shipped the steps
    since its checkpoint (which follows fragment 0's delta), so their batches are not read again."""
    try:
        status = read_record(ctx.store, ctx.keys.status(name), LearnerStatus)
    except (NotFound, RecordError):
        return cursor, step
    return max(cursor, status.cursor), max(step, status.step)


def _from_checkpoint(ctx: RunContext, name: str, events: EventLog,
                     import_optimizer: ImportOptimizer) -> tuple[int, int]:
    """(optimizer step, data cursor) from the bucket checkpoint (diloco.learner.checkpoint: the pointer after
    the last delta, the moments of up to learner.checkpoint_every before it); (0, 0) and a fresh optimizer
    without one; the pointer's step and cursor with a fresh optimizer when it names no moments yet."""
    try:
        restored = read_checkpoint(ctx.store, ctx.keys, name, ctx.fingerprint)
        if restored is None:
            return 0, 0
        if restored.tensors is not None:
            import_optimizer(restored.tensors, restored.optimizer)
    except (CodecError, StorageError, RecordError, ValueError) as err:
        log.warning("learner %s: checkpoint unreadable or does not fit (%s); starting fresh state", name, err)
        events.emit("checkpoint_unreadable", learner=name, reason=str(err))
        return 0, 0
    events.emit("resume", learner=name, step=restored.step, cursor=restored.cursor,
                checkpoint_seq=restored.seq, moments_seq=restored.moments_seq)
    return restored.step, restored.cursor

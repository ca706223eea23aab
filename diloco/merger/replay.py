"""Replaying a chain's merges from the log: how a merger that does not hold a version's state gets it back (at
its start, after a lost commit race, after a failed commit), and how `fork` gets a version's outer state.

Contract: `replay_merge(ctx, prev, m, params, outer)` merges manifest m again on the state of version m - 1
(consumed, in place, as the merger's own step): its merged deltas as recorded (each checked against its
recorded checksum, scaled by its recorded clip), folded learner by learner in the recorded order, with the
live settings m's merge went by — never judged again (audit does that) — and checks the update it makes
against m's: the committed checksum, or the same header and values. A mismatch raises ReplayMismatch, and
the merger stops: the outer step runs in place and cannot be undone, so it never merges on a state it could
not reproduce. `recover(ctx, manifest)` = the newest checkpoint at or before the version (or a state the
caller holds, when nearer) + every merge after it, replayed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from diloco.configs import Config
from diloco.merger.inplace import outer_step_in_place
from diloco.merger.step import (
    LearnerGroup,
    OuterState,
    StepResult,
    counter_bounds,
    gradient_stream,
    outer_optimizer,
)
from diloco.run.checkpoint import checkpoint_of, read_start
from diloco.run.context import RunContext, direct_names
from diloco.run.objects import (
    CorruptObject,
    Prefetch,
    decode_tensors,
    read_ahead,
    read_checked,
    read_committed,
    read_tensors,
)
from diloco.storage import Manifest, StorageError
from diloco.storage.codec import CodecError, decode, object_checksum, read_header
from diloco.storage.manifest import CheckpointRef
from diloco.storage.window import read_full_manifest
from diloco.training.fp64 import Arena
from diloco.training.tensors import Tensors
from diloco.trust.guard import check_settings

log = logging.getLogger("diloco.merger")


class ReplayMismatch(CorruptObject):
    """A replayed merge does not make the update its manifest committed: the log cannot make the chain."""


@dataclass
class ChainState:
    """A chain's state at `manifest`'s version: what a merger holds between merges."""

    manifest: Manifest
    params: Tensors
    outer: OuterState | None  # None: zeros (a version no merge has stepped: version 0)
    ema: dict[str, float]
    checkpoint: CheckpointRef | None = None  # the newest checkpoint at or before it known (None: schema 1)
    replayed: int = 0  # merges replayed to get here
    read_s: float = 0.0  # reading the checkpoint (or the schema 1 objects)
    replay_s: float = 0.0


def merge_config(ctx: RunContext, m: Manifest) -> Config:
    """The live config m's merge went by: run.json's with the settings in force (its guard's; none before the
    guard)."""
    return ctx.cfg if m.guard is None else check_settings(ctx.cfg, m.guard.settings)


def layout_of(ctx: RunContext, params: Tensors) -> Tensors:
    """What a merge checks deltas against: run.json's layout as meta tensors (the params for a run without
    one)."""
    import torch

    if not ctx.layout:
        return params
    return {e["name"]: torch.empty(e["shape"], device="meta") for e in ctx.layout}


def _delta(ctx: RunContext, m: Manifest, learner: str, seq: int, checksum: str, clip: float | None):
    key = ctx.keys.delta(learner, seq)
    try:
        data = read_checked(ctx.store, key, checksum)
        header, delta = decode_tensors(data, fingerprint=ctx.fingerprint, verified=bool(checksum))
    except CodecError as err:
        raise ReplayMismatch(f"replaying version {m.version} of run {ctx.run_id}: merged delta {key} no "
                             f"longer matches its manifest ({err})") from None
    if clip is not None:  # the judge's clip: the parameters scaled, never the buffers after them
        names = list(delta)
        for name in names[:len(names) - int(header.meta.get("buffers", 0))]:
            delta[name].mul_(clip)
    return header, delta


def replay_merge(ctx: RunContext, prev: Manifest, m: Manifest, params: Tensors,
                 outer: OuterState | None, deltas: Iterator | None = None,
                 arena: Arena | None = None) -> StepResult:
    """Merge m again on version prev's state (consumed: `params` becomes m's, `outer` is emptied) and check
    its update against m's; ReplayMismatch when it differs, CorruptObject/StorageError when an input cannot
    be read. The next delta is read, checked and decoded on a second thread while this one is folded (the
    same bits: the fold's order is the recorded one); `deltas`: a Prefetch's iterator of recover's, over the
    merged deltas of this merge and those after it ((manifest, decision), (header, delta)), instead;
    `arena`: the merger's kept block the fp64 sums are laid in (None: fresh)."""
    cfg = merge_config(ctx, m)
    layout = layout_of(ctx, params)
    stream = gradient_stream(layout, prev.version, cfg.outer, direct_names(ctx, layout), ctx.buffers,
                             counter_bounds(cfg, ctx.tokens_per_step), arena=arena)  # the merge's own bounds
    group: LearnerGroup | None = None
    merged = m.merged()

    def load(d):
        return _delta(ctx, m, d.learner, d.seq, d.checksum, d.clip_scale)

    pairs = read_ahead(merged, load, "replay-read") if deltas is None else _taken(deltas, m, merged)
    # a learner's deltas are contiguous, in the merger's order
    for d, (header, delta) in pairs:
        if group is not None and group.learner != d.learner:
            stream.add(group)
            group = None
        group = group or LearnerGroup(d.learner)
        group.add(d.seq, header, delta)
        del header, delta
    if group is not None:
        stream.add(group)
    finished = stream.finish()
    optimizer = outer_optimizer(cfg, len(ctx.learners))
    result = outer_step_in_place(params, outer, stream, ctx.fingerprint, optimizer, finished)
    if not same_update(ctx, m, result.update_bytes):
        raise ReplayMismatch(
            f"run {ctx.run_id}{_chain(ctx)}: the replay of version {m.version} makes another update than the "
            f"one committed ({m.update_key}): the state rebuilt from the log is not the chain's. The merger "
            "stops rather than merge on it; `diloco audit` replays and names the first version that differs")
    return result


def _taken(deltas: Iterator, m: Manifest, merged: list) -> Iterator:
    """(decision, (header, delta)) of m's merged deltas, taken from recover's shared prefetch in order."""
    for d in merged:
        (of, decided), got = next(deltas)
        if of.version != m.version or (decided.learner, decided.seq) != (d.learner, d.seq):
            raise RuntimeError(f"replay of version {m.version}: prefetched {decided.learner}/{decided.seq} "
                               f"of version {of.version} out of order")
        yield d, got
        del got


def _chain(ctx: RunContext) -> str:
    return "" if ctx.keys.fragment is None else f" fragment {ctx.keys.fragment}"


def same_update(ctx: RunContext, m: Manifest, replayed: bytes) -> bool:
    """The replayed update is the committed one: the same bytes, or (when a zstd of another version packs the
    same frames differently) the same header and the same values, bit for bit."""
    if object_checksum(replayed) == m.update_checksum:
        return True
    try:
        h1, ours = decode(replayed)
        h2, theirs = decode(ctx.store.get(m.update_key))
    except (StorageError, CodecError):
        return False
    return (h1.codec, h1.meta, h1.tensors) == (h2.codec, h2.meta, h2.tensors) and \
        all(np.array_equal(ours[k], theirs[k]) for k in ours)


def _schema1_state(ctx: RunContext, manifest: Manifest) -> ChainState:
    """A manifest that names its own params and outer state (schema 1, or version 0 of a run made before the
    log)."""
    t0 = time.perf_counter()
    what = f"version {manifest.version}'s"
    _, params = read_committed(ctx.store, manifest.params_key, fingerprint=ctx.fingerprint,
                               checksum=manifest.params_checksum, what=f"{what} params")
    outer, ema = None, {}
    if manifest.outer_key:
        header, raw = read_tensors(ctx.store, manifest.outer_key, fingerprint=ctx.fingerprint,
                                   checksum=manifest.outer_checksum)
        outer = OuterState.from_tensors(raw, params)
        ema = {k: float(v) for k, v in header.meta.get("ema", {}).items()}
    return ChainState(manifest, params, outer, ema, read_s=time.perf_counter() - t0)


def ema_of(ctx: RunContext, manifest: Manifest) -> dict[str, float]:
    """The grace window's moving averages after `manifest`'s merge: its own (the log), else its outer
    object's."""
    if manifest.ema or not manifest.outer_key:
        return dict(manifest.ema)
    header = read_header(read_checked(ctx.store, manifest.outer_key, manifest.outer_checksum))
    return {k: float(v) for k, v in header.meta.get("ema", {}).items()}


REPLAY_AHEAD = 2  # deltas a recovering merger reads ahead of its replay (each held decoded: fragment fp32)


def recover(ctx: RunContext, manifest: Manifest, held: ChainState | None = None, *,
            newest: bool = True, arena: Arena | None = None) -> ChainState:
    """The chain's state at `manifest`'s version: from `held` (a state at an older version of this chain,
    consumed) when it is at or past the checkpoint, else from the checkpoint (`newest`: or a newer one that
    landed since); then every merge after it replayed and checked (`arena`: the merger's fp64 block)."""
    if held is not None and held.manifest.version == manifest.version:
        return held
    usable = held is not None and held.manifest.version < manifest.version
    if manifest.params_key:  # schema 1: the version holds its state
        return _schema1_state(ctx, manifest)
    ref = checkpoint_of(ctx, manifest, newest=newest)
    t0 = time.perf_counter()
    first = held.manifest.version if usable and held.manifest.version >= ref.version else ref.version
    # with their windows: a clipped delta's scale is the merger's own figure
    logs = [manifest if v == manifest.version else read_full_manifest(ctx.store, ctx.keys, v)
            for v in range(first + 1, manifest.version + 1)]
    items = [(m, d) for m in logs for d in m.merged()]
    # the merges' deltas start arriving while the checkpoint is read, the next merge's while this one steps
    with Prefetch(items, lambda item: _delta(ctx, item[0], item[1].learner, item[1].seq, item[1].checksum,
                                             item[1].clip_scale), "replay-read", depth=REPLAY_AHEAD) as ahead:
        if usable and held.manifest.version >= ref.version:
            state = held
            state.checkpoint = ref
        else:
            held = None  # freed before the checkpoint is read
            checkpoint = read_start(ctx, manifest, outer=True, newest=newest, ref=ref)
            ref = checkpoint.ref
            start = manifest if ref.version == manifest.version else \
                read_full_manifest(ctx.store, ctx.keys, ref.version)
            state = ChainState(start, checkpoint.params, checkpoint.outer, checkpoint.ema, checkpoint=ref,
                               read_s=time.perf_counter() - t0)
        t1 = time.perf_counter()
        prev = state.manifest
        todo = [m for m in logs if m.version > prev.version]  # retention may have moved the start on
        ahead.skip_until(lambda item: item[0].version > prev.version)
        deltas = iter(ahead)
        for m in todo:
            result = replay_merge(ctx, prev, m, state.params, state.outer, deltas=deltas, arena=arena)
            state.params, state.outer, prev = result.params, result.outer, m
            state.replayed += 1
            del result
    state.manifest, state.ema = manifest, ema_of(ctx, manifest)
    state.replay_s += time.perf_counter() - t1
    if state.replayed:
        log.info("run %s%s: state of version %d rebuilt from checkpoint %d and %d replayed merges (%.1f s)",
                 ctx.run_id, _chain(ctx), manifest.version, ref.version, state.replayed,
                 state.read_s + state.replay_s)
    return state

"""One merge's reading and judging: the deltas read, judged and folded learner by learner into the decisions
its manifest records and the gradient stream its outer step takes.

Contract: streamed (memory does not grow with the number of learners); a learner that may not publish is
rejected without a read, an oversized delta is never read, and no delta stops the merge (judging it failed:
rejected), while the bucket's own trouble (StorageError) propagates for the loop to back off and retry.
Two threads, the same bits: a second one computes each delta's norm (tensor by tensor, in order, while the
delta is decoded) and folds each learner's group into the stream (freeing its tensors as they are folded,
while the next learner's delta is read and decoded: tensor i of the next one only once tensor i of the fold
is freed, FoldGate), so about one decoded delta is held, as in one thread; every operation runs whole on one
thread (torch at one thread) in the order the one-thread merge runs it. A folded tensor's memory is the
next delta's tensor of that name (Recycler): after the first learner a merge decodes into memory it already
has, not into fresh pages (at 124M, 0.5 GB of page faults a delta, taken beside the fold's frees).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from diloco.merger.step import GradientStream, LearnerGroup, MergeArenas, counter_bounds, gradient_stream
from diloco.merger.waiting import Pending
from diloco.run.context import RunContext, direct_names
from diloco.run.events import EventLog
from diloco.storage import DeltaDecision, NotFound, StorageError
from diloco.training.tensors import Tensors
from diloco.trust.guard import Policy, gate
from diloco.trust.judge import Judge

log = logging.getLogger("diloco.merger")


def decide(ctx: RunContext, version: int, layout: Tensors, pending: Pending, policy: Policy,
           keyring: dict[str, list[bytes]] | None, strangers: set[str],
           events: EventLog, arenas: MergeArenas | None = None,
           ) -> tuple[list[DeltaDecision], GradientStream, list[float], Judge]:
    """Read, judge and fold the deltas on top of `version` learner by learner (streamed: memory does not grow
    with the number of learners); a learner that may not publish is rejected without a read. Each stranger
    decided joins `strangers` (its folder is not listed again). `arenas`: the merger's kept blocks the fp64
    sums are laid in and the deltas first decoded into (None: fresh); then `judge.reuse` holds the folded
    deltas' buffers, for the pseudo-gradient (GradientStream.finish(into=judge.reuse.tensor)), until the
    caller lets it go."""
    with ThreadPoolExecutor(1, thread_name_prefix="merge-fold") as worker:
        decisions, stream, phase_times, judge, folds = _decide(ctx, version, layout, pending, policy, keyring,
                                                               strangers, events, worker, arenas)
        for fold in folds:
            fold.result()  # a fold's error is the merge's
    return decisions, stream, phase_times, judge


def _decide(ctx: RunContext, version: int, layout: Tensors, pending: Pending, policy: Policy,
            keyring: dict[str, list[bytes]] | None, strangers: set[str], events: EventLog,
            worker: ThreadPoolExecutor, arenas: MergeArenas | None):
    decisions: list[DeltaDecision] = []
    stream = gradient_stream(layout, version, policy.cfg.outer, direct_names(ctx, layout), ctx.buffers,
                             counter_bounds(policy.cfg, ctx.tokens_per_step),
                             arena=None if arenas is None else arenas.sums)
    # each tensor's first delta is decoded into the kept fp32 block, the next into what the fold gave back
    seed = None if arenas is None else arenas.buffers.views({k: tuple(v.shape) for k, v in layout.items()})
    fold_gate, recycler = FoldGate(), Recycler(seed)
    judge = Judge(ctx.run_id, ctx.fingerprint, version, layout, policy, keyring, buffers=ctx.buffers,
                  apart=ctx.window_apart, worker=worker, gate=fold_gate, chunked_norms=ctx.chunked_norms,
                  reuse=recycler)
    folds: list[Future] = []

    def fold(group: LearnerGroup) -> None:
        try:
            stream.add(group, consume=True, on_folded=fold_gate.folded, recycle=recycler.give)
        finally:
            fold_gate.finished()

    phase_times: list[float] = []
    for learner, (first, last) in sorted(pending.strangers.items()):  # one decision, no cursor, never again
        rejected = gate(policy, learner, first)
        if rejected is None:  # admitted since its keys were listed (the ops read again): merged next time
            continue
        strangers.add(learner)
        decisions.append(DeltaDecision(learner=learner, seq=first, seq_last=last if last != first else None,
                                       status="rejected", check="admission",
                                       reason=rejected.reason))  # its keys not read
    for learner, (first, last) in sorted(pending.lost.items()):
        seqs = f"seq {first}" if first == last else f"seqs {first}..{last}"
        decisions.append(DeltaDecision(
            learner=learner, seq=first, seq_last=last if last != first else None, status="lost",
            reason=f"{seqs} missing for over {policy.cfg.merger.gap_timeout_s:g}s while later seqs arrived"))
    for learner, seqs in sorted(pending.ready.items()):
        group = LearnerGroup(learner)
        for seq in seqs:
            decision, header, delta = gate(policy, learner, seq), None, None
            if decision is None:
                decision, header, delta = read_one(ctx, judge, learner, seq)
            decisions.append(decision)
            if decision.status == "merged":
                group.add(seq, header, delta)
                delta = None  # the group holds it (the fold frees it tensor by tensor)
                phase_times.append(float(header.meta.get("phase_time_s", 0.0) or 0.0))
            elif decision.status == "rejected":
                # the figures too (the outlier rule's detail): the merger's log and events are the operator's
                detail = f" ({decision.detail})" if decision.detail else ""
                log.warning("rejected %s/%d: %s%s", learner, seq, decision.reason, detail)
                events.emit("rejected", learner=learner, seq=seq, reason=decision.reason + detail,
                            check=decision.check, version=version)
        if group.seqs:  # folded on the worker (after this group's norms, before the next's)
            fold_gate.started()
            folds.append(worker.submit(fold, group))
            group = None
    return decisions, stream, phase_times, judge, folds


class FoldGate:
    """How far the pending fold has got through its group's tensors: decoding tensor i of the next delta
    waits until tensor i of the fold is folded and freed (`wait(i)`), so the two deltas together stay near
    one. Every earlier fold has finished when the next starts (its norms ran after it on the one worker)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._folded: int | None = None  # None: no fold pending

    def started(self) -> None:
        with self._cond:
            self._folded = -1

    def folded(self, index: int) -> None:
        with self._cond:
            self._folded = index
            self._cond.notify_all()

    def finished(self) -> None:
        with self._cond:
            self._folded = None
            self._cond.notify_all()

    def wait(self, index: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._folded is None or self._folded >= index)


class Recycler:
    """The fold's consumed tensors kept by name for the next delta's tensor of that name to be decoded into
    (Judge.reuse): the fold gives tensor i back before FoldGate hears it is folded, so the decoder, which
    waits for that, finds it. Nobody else holds a consumed tensor (the stream pops it from its group).
    `seed`: fp32 buffers nobody holds (an arena's views), one per name, the first ones handed out."""

    def __init__(self, seed: dict[str, torch.Tensor] | None = None) -> None:
        self._lock = threading.Lock()
        self._free: dict[str, np.ndarray] = {}
        for name, value in (seed or {}).items():
            self.give(name, value)

    def give(self, name: str, value: torch.Tensor) -> None:
        if value.dtype == torch.float32 and value.is_contiguous():
            with self._lock:
                self._free[name] = value.numpy()

    def take(self, name: str) -> np.ndarray | None:
        with self._lock:
            return self._free.pop(name, None)

    def tensor(self, name: str) -> torch.Tensor | None:
        """take(name) as a tensor (sharing its memory), or None."""
        free = self.take(name)
        return None if free is None else torch.from_numpy(free)


def read_one(ctx: RunContext, judge: Judge, learner: str, seq: int):
    """Fetch one delta (its size first: an oversized one is never read) and its signature, then judge it."""
    key = ctx.keys.delta(learner, seq)
    try:
        size = ctx.store.get_size(key)
        data = ctx.store.get(key) if size <= judge.max_bytes else None
        signature = _signature(ctx, learner, seq) if judge.cfg.learner.sign and data is not None else None
    except NotFound:
        return DeltaDecision(learner=learner, seq=seq, status="lost",
                             reason="object vanished after listing"), None, None
    try:
        return judge.judge(learner, seq, size, data, signature)
    except StorageError:
        raise  # the bucket's trouble, not the delta's: the loop backs off and retries
    except Exception as err:  # noqa: BLE001 - no delta may stop the merge loop (a MemoryError included)
        log.error("judging %s/%d failed: %s: %s; rejected", learner, seq, type(err).__name__, err)
        reason = f"judging it failed: {type(err).__name__}: {err}"[:500]
        return DeltaDecision(learner=learner, seq=seq, status="rejected", check="error", reason=reason), \
            None, None


def _signature(ctx: RunContext, learner: str, seq: int) -> bytes | None:
    try:
        return ctx.store.get(ctx.keys.signature(learner, seq))
    except NotFound:
        return None

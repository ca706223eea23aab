"""One merge's reading and judging: the deltas read, judged and folded learner by learner into the decisions
its manifest records and the gradient stream its outer step takes.

Contract: streamed (memory does not grow with the number of learners); a learner that may not publish is
rejected without a read, an oversized delta is never read, and no delta stops the merge (judging it failed:
rejected), while the bucket's own trouble (StorageError) propagates for the loop to back off and retry.
Two threads, the same bits: a second one computes each delta's norm (tensor by tensor, in order, while the
delta is decoded) and folds each learner's group into the stream (freeing its tensors as they are folded,
while the next learner's delta is read and decoded), so at most about one decoded delta is held; every
operation runs whole on one thread (torch at one thread) in the order the one-thread merge runs it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from diloco.merger.step import GradientStream, LearnerGroup, counter_bounds, gradient_stream
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
           events: EventLog) -> tuple[list[DeltaDecision], GradientStream, list[float], Judge]:
    """Read, judge and fold the deltas on top of `version` learner by learner (streamed: memory does not grow
    with the number of learners); a learner that may not publish is rejected without a read. Each stranger
    decided joins `strangers` (its folder is not listed again)."""
    with ThreadPoolExecutor(1, thread_name_prefix="merge-fold") as worker:
        decided = _decide(ctx, version, layout, pending, policy, keyring, strangers, events, worker)
        for fold in decided[-1]:
            fold.result()  # a fold's error is the merge's
    return decided[:-1]


def _decide(ctx: RunContext, version: int, layout: Tensors, pending: Pending, policy: Policy,
            keyring: dict[str, list[bytes]] | None, strangers: set[str], events: EventLog,
            worker: ThreadPoolExecutor):
    decisions: list[DeltaDecision] = []
    stream = gradient_stream(layout, version, policy.cfg.outer, direct_names(ctx, layout), ctx.buffers,
                             counter_bounds(policy.cfg, ctx.tokens_per_step))
    judge = Judge(ctx.run_id, ctx.fingerprint, version, layout, policy, keyring, buffers=ctx.buffers,
                  apart=ctx.window_apart, worker=worker)
    folds: list[Future] = []
    phase_times: list[float] = []
    for learner, (first, last) in sorted(pending.strangers.items()):  # one decision, no cursor, never again
        strangers.add(learner)
        decisions.append(DeltaDecision(learner=learner, seq=first, seq_last=last if last != first else None,
                                       status="rejected", check="admission",
                                       reason=gate(policy, learner, first).reason))  # its keys not read
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
            folds.append(worker.submit(stream.add, group, consume=True))
    return decisions, stream, phase_times, judge, folds


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

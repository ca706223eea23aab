"""The audit of the guard: every control op recorded once and as filed, and every decision of a merge —
admission, quarantine, signature, validation, the outlier rule with its statistics — recomputed from the
stored objects, with the guard state that follows.

Contract: read-only; problems go to the report (diloco.inspect.audit.AuditReport); a rejected delta whose
object changed or vanished since its decision, or a signature check without a keyring, is counted as
unreplayable, not as a problem (the merged ones always replay: their objects are pinned by checksum).
"""

from __future__ import annotations

from typing import Any

from diloco.merger.step import GradientStream, LearnerGroup, counter_bounds, gradient_stream
from diloco.run.context import RunContext, direct_names
from diloco.run.controls import list_ops, read_op
from diloco.storage import DeltaDecision, Manifest, NotFound
from diloco.storage.codec import object_checksum
from diloco.storage.records import RecordError
from diloco.trust.guard import Policy, entry_of, fold, gate, policy_after, state_of
from diloco.trust.judge import Judge

FIELDS = ("status", "reason", "check", "norm", "clip_scale", "detail", "base_version", "staleness", "tokens",
          "steps", "bytes", "checksum")


def check_controls(ctx: RunContext, chain: list[Manifest], report: Any) -> None:
    """Each recorded op is an op object of the bucket with the same content, recorded once; none filed before
    the last applied one was skipped."""

    recorded: dict[str, int] = {}
    for m in chain:
        for e in m.controls:
            if e.name in recorded:
                report.problem(f"control op {e.name} applied twice (versions {recorded[e.name]} and "
                               f"{m.version})")
            recorded[e.name] = m.version
            report.controls_applied += 1
            if e.kind == "invalid":
                continue
            try:
                op = read_op(ctx.store, ctx.keys, e.name)
            except (NotFound, RecordError) as err:
                report.problem(f"version {m.version}: control op {e.name} is recorded but unreadable: {err}")
                continue
            if entry_of(e.name, op).model_dump(exclude={"refused"}) != e.model_dump(exclude={"refused"}):
                report.problem(f"version {m.version}: control op {e.name} differs from the recorded one")
    cursor = max((m.guard.ops_cursor for m in chain if m.guard is not None), default="")
    for name in list_ops(ctx.store, ctx.keys):
        if name <= cursor and name not in recorded:
            report.problem(f"control op {name} was filed before the last applied one but never applied")


def _fetch(ctx: RunContext, judge: Judge, d: DeltaDecision, report: Any):
    """(size, data, signature) of a decided delta as stored now, or None when it cannot be replayed."""
    key = ctx.keys.delta(d.learner, d.seq)
    try:
        size = ctx.store.get_size(key)
        data = ctx.store.get(key) if size <= judge.max_bytes else None
    except NotFound:
        if d.status == "merged":
            report.problem(f"delta {d.learner}/{d.seq} was merged but is missing")
        else:
            report.decisions_unreplayable += 1
        return None
    if d.checksum and data is not None and object_checksum(data) != d.checksum:
        if d.status != "merged":  # a merged one's mismatch is reported by check_decisions
            report.decisions_unreplayable += 1
        return None
    if judge.cfg.learner.sign and judge.keyring is None:
        if d.check == "signature":
            report.decisions_unreplayable += 1
            return None
        return size, data, None
    signature = None
    if judge.cfg.learner.sign and data is not None:
        try:
            signature = ctx.store.get(ctx.keys.signature(d.learner, d.seq))
        except NotFound:
            signature = None
    return size, data, signature


def _redo(ctx: RunContext, judge: Judge, policy: Policy, d: DeltaDecision, version: int, report: Any):
    gated = gate(policy, d.learner, d.seq)
    if gated is not None:
        return gated, None, None
    if d.check in ("admission", "quarantine"):
        report.problem(f"version {version}: {d.learner}/{d.seq} recorded as {d.check} but the policy lets it "
                       "in")
        return None, None, None
    fetched = _fetch(ctx, judge, d, report)
    if fetched is None:
        return None, None, None
    return judge.judge(d.learner, d.seq, *fetched)


def replay_decisions(ctx: RunContext, prev: Manifest, m: Manifest, params, report: Any,
                     keyring: dict[str, list[bytes]] | None) -> tuple[GradientStream, Any]:
    """Recompute manifest m's policy, decisions, statistics and guard state; returns the merge's stream of
    (replayed, clipped where the rule clipped) deltas and its live config, for the bit-for-bit outer step."""
    entries = [e.model_copy(update={"refused": e.refused if e.kind == "invalid" else ""}) for e in m.controls]
    policy = policy_after(state_of(prev, ctx.learners), entries, ctx.cfg)
    if [e.model_dump() for e in policy.entries] != [e.model_dump() for e in m.controls]:
        report.problem(f"version {m.version}: the control ops replay differently than recorded")
    judge = Judge(ctx.run_id, ctx.fingerprint, prev.version, params, policy,
                  keyring if ctx.cfg.learner.sign else None, buffers=ctx.buffers,
                  apart=ctx.window_apart, chunked_norms=ctx.chunked_norms)
    stream = gradient_stream(params, prev.version, policy.cfg.outer, direct_names(ctx, params), ctx.buffers,
                             counter_bounds(policy.cfg, ctx.tokens_per_step))
    group: LearnerGroup | None = None
    for d in m.decisions:
        if d.status == "lost" or d.seq_last is not None:
            continue  # declared by time (a gap that waited) or by listing (a stranger's keys), not by content
        redo, header, delta = _redo(ctx, judge, policy, d, m.version, report)
        if redo is None:
            continue
        diff = [f"{f} {getattr(d, f)!r} != replayed {getattr(redo, f)!r}"
                for f in FIELDS if getattr(d, f) != getattr(redo, f)]
        if diff:
            report.problem(f"version {m.version}: decision of {d.learner}/{d.seq} differs on replay: "
                           f"{'; '.join(diff)}")
            continue
        report.decisions_replayed += 1
        if redo.status == "merged":
            if group is not None and group.learner != d.learner:
                stream.add(group)
                group = None
            group = group or LearnerGroup(d.learner)
            group.add(d.seq, header, delta)
    if group is not None:
        stream.add(group)
    _check_stats(judge, policy, prev, m, report, ctx.trust_rules)
    return stream, policy.cfg


def _check_stats(judge: Judge, policy: Policy, prev: Manifest, m: Manifest, report: Any, rules: int) -> None:
    median = judge.median()
    if m.stats.get("outlier_median") != median and not (median is None and "outlier_median" not in m.stats):
        report.problem(f"version {m.version}: outlier median {m.stats.get('outlier_median')!r} != replayed "
                       f"{median!r}")
    guard, _ = fold(policy.state, m.decisions, m.version, policy.cfg, rules)
    where = {"window"}  # where the window is kept is no part of the state (checked by audit.load_chain)
    if m.guard is None or guard.model_dump(exclude=where) != m.guard.model_dump(exclude=where):
        report.problem(f"version {m.version}: the guard state differs on replay (parent v{prev.version})")

"""`audit`: prove a run's history — contiguous manifests, checksums, at-most-once merging, every
delta decided, and a bit-for-bit replay of every merge from the stored objects (the merged buffers too) — on
every chain of the run: the root chain of a whole-model run, or each fragment's (the root then holds version 0
only).

Contract: read-only; returns every problem found rather than stopping at the first; one report over the chains
(a fragment chain's problems name their fragment), `ok` only when every chain is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.inspect.audit_state import check_object, check_state_objects, read_retention, replay_chain
from diloco.inspect.audit_trust import check_controls, replay_decisions
from diloco.merger.step import LearnerGroup, gradient_stream
from diloco.merger.waiting import plausible_ahead
from diloco.run.context import RunContext, direct_names
from diloco.run.fragments import chain_contexts
from diloco.run.objects import read_tensors
from diloco.run.pin import note_pin, pin_state
from diloco.storage import Manifest, StorageError, list_versions, read_manifest
from diloco.storage.codec import CodecError
from diloco.storage.keys import parse_delta_key
from diloco.storage.window import with_window


@dataclass
class AuditReport:
    ok: bool = True
    num_versions: int = 0
    deltas_merged: int = 0
    deltas_rejected: int = 0
    deltas_lost: int = 0
    deltas_pending: int = 0  # published after the last merge of a run that has ended
    # keys no merge decides: a name never admitted, a seq further ahead than a learner can be
    deltas_ignored: int = 0
    decisions_replayed: int = 0  # decisions recomputed from the stored objects and found equal
    # rejected deltas whose object changed or vanished since, or signatures without keys
    decisions_unreplayable: int = 0
    signatures_verified: bool = False  # a keyring was at hand (learner.sign runs)
    controls_applied: int = 0  # operator control ops recorded in manifests
    replay_ok: bool = True
    problems: list[str] = field(default_factory=list)
    # a fragmented run: versions per fragment chain
    fragment_versions: list[int] = field(default_factory=list)
    run_json: str = ""  # run.json against version 0's pin (diloco.run.pin)
    # the log (docs/STORAGE.md): merges replayed, stored states (checkpoints, schema-1 objects) found equal to
    # the replay, complete checkpoints that are no committed version's state; where the kept history starts
    # (gc's
    # retention: the oldest version whose state is kept, per chain; 0 = all of it)
    versions_replayed: int = 0
    checkpoints_compared: int = 0
    checkpoints_unnamed: int = 0
    history_from: list[int] = field(default_factory=list)

    COUNTS = ("deltas_merged", "deltas_rejected", "deltas_lost", "deltas_pending", "deltas_ignored",
              "decisions_replayed", "decisions_unreplayable", "controls_applied", "versions_replayed",
              "checkpoints_compared", "checkpoints_unnamed")

    def problem(self, text: str) -> None:
        self.ok = False
        self.problems.append(text)

    def add(self, chain: AuditReport, prefix: str = "") -> None:
        """Fold one chain's report into this one (its problems prefixed, e.g. with its fragment)."""
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + getattr(chain, name))
        self.replay_ok = self.replay_ok and chain.replay_ok
        self.history_from += chain.history_from
        for text in chain.problems:
            self.problem(prefix + text)

    def to_json(self) -> dict:
        return {"ok": self.ok, "num_versions": self.num_versions, "deltas_merged": self.deltas_merged,
                "deltas_rejected": self.deltas_rejected, "deltas_lost": self.deltas_lost,
                "deltas_pending": self.deltas_pending, "deltas_ignored": self.deltas_ignored,
                "decisions_replayed": self.decisions_replayed,
                "decisions_unreplayable": self.decisions_unreplayable,
                "signatures_verified": self.signatures_verified,
                "controls_applied": self.controls_applied, "replay_ok": self.replay_ok,
                "problems": self.problems,
                "run_json": self.run_json, "versions_replayed": self.versions_replayed,
                "checkpoints_compared": self.checkpoints_compared,
                "checkpoints_unnamed": self.checkpoints_unnamed,
                "history_from": self.history_from,
                **({"fragment_versions": self.fragment_versions} if self.fragment_versions else {})}


def load_chain(ctx: RunContext, report: AuditReport) -> list[Manifest]:
    versions = list_versions(ctx.store, ctx.keys)
    if versions != list(range(len(versions))):
        report.problem(f"manifest chain is not contiguous from 0: {versions[:20]}")
    chain = []
    for v in versions:
        try:
            m = read_manifest(ctx.store, ctx.keys, v)
        except (StorageError, ValueError) as err:
            report.problem(f"version {v}: unreadable manifest: {err}")
            continue
        m = _with_window(ctx, m, report)
        if m.version != v or (v > 0 and m.parent != v - 1):
            report.problem(f"version {v}: manifest says version {m.version}, parent {m.parent}")
        chain.append(m)
    report.num_versions = len(chain)
    return chain


def _with_window(ctx: RunContext, m: Manifest, report: AuditReport) -> Manifest:
    """The manifest with its outlier window (storage.window): a window object unreadable, or a run of trust
    rules 3 whose merge published its window in the manifest, is a problem."""
    if ctx.window_apart and m.version > 0 and m.guard is not None and m.guard.window is None:
        report.problem(f"version {m.version}: its outlier window is published in the manifest (trust rules "
                       f"{ctx.trust_rules} keep it in {ctx.keys.guard_prefix()})")
    try:
        return with_window(ctx.store, ctx.keys, m)
    except (StorageError, ValueError) as err:
        report.problem(f"version {m.version}: its outlier window is unreadable: {err}")
        return m


def check_decisions(ctx: RunContext, chain: list[Manifest], report: AuditReport, start: int = 0) -> None:
    """At-most-once, cursors, every delta decided; a merged delta's object against its checksum (of the
    versions after `start`: retention removed those merged at or before it)."""
    decided: dict[tuple[str, int], int] = {}
    # learner -> (first, last) of each range one decision decided
    ranges: dict[str, list[tuple[int, int]]] = {}
    cursors: dict[str, int] = {}
    for m in chain:
        for d in m.decisions:
            key = (d.learner, d.seq)
            # decided again by a restarted merger
            stranger = d.check == "admission" and d.learner not in cursors
            if key in decided and not stranger:
                report.problem(f"delta {d.learner}/{d.seq} decided twice (versions {decided[key]} and "
                               f"{m.version})")
            decided[key] = m.version
            if d.seq_last is not None:  # one decision for a range: a gap declared lost, a stranger's keys
                ranges.setdefault(d.learner, []).append((d.seq, d.seq_last))
                report.deltas_lost += (d.seq_last - d.seq) if d.status == "lost" else 0
                if d.seq_last < d.seq or not (d.status == "lost" or stranger):
                    report.problem(f"delta {d.learner}/{d.seq}: a range to {d.seq_last} that is neither lost "
                                   "nor a stranger's")
            if d.status == "merged":
                report.deltas_merged += 1
                if d.seq <= cursors.get(d.learner, -1):
                    report.problem(f"delta {d.learner}/{d.seq} merged at or below the cursor in version "
                                   f"{m.version}")
                if m.version > start:
                    key = ctx.keys.delta(d.learner, d.seq)
                    check_object(ctx, key, d.checksum, f"version {m.version}", report)
            elif d.status == "rejected":
                report.deltas_rejected += 1
                if not d.reason:
                    report.problem(f"delta {d.learner}/{d.seq} rejected without a reason")
            else:
                report.deltas_lost += 1
        for learner, seq in m.cursors.items():
            if seq < cursors.get(learner, -1):
                report.problem(f"version {m.version}: cursor of {learner} went backwards")
        cursors = dict(m.cursors)
    members = set(chain[-1].guard.members if chain and chain[-1].guard else ctx.learners)
    ahead = plausible_ahead(ctx.cfg.learner.max_unmerged)
    for key in ctx.store.list(ctx.keys.deltas_prefix()):
        parsed = parse_delta_key(key)
        if parsed is None or parsed in decided:
            continue
        learner, seq = parsed
        if any(first <= seq <= last for first, last in ranges.get(learner, ())):
            continue  # decided with its range: declared lost (its object came after), or a stranger's
        if learner not in members and learner not in cursors or seq >= cursors.get(learner, -1) + 1 + ahead:
            # a stranger's key, or one further ahead than a learner can be: no delta
            report.deltas_ignored += 1
        elif seq > cursors.get(learner, -1):
            report.deltas_pending += 1
        else:
            report.problem(f"delta {learner}/{seq} is at or below the cursor but was never decided")


def _legacy_stream(ctx: RunContext, prev: Manifest, m: Manifest, params):
    """A manifest written before the guard (no GuardState): the merged deltas as recorded, run.json's
    config."""
    stream = gradient_stream(params, prev.version, ctx.cfg.outer, direct_names(ctx, params), ctx.buffers)
    group: LearnerGroup | None = None
    for d in m.merged():  # a learner's deltas are contiguous, in the merger's order
        if group is not None and group.learner != d.learner:
            stream.add(group)
            group = None
        header, delta = read_tensors(ctx.store, ctx.keys.delta(d.learner, d.seq), checksum=d.checksum)
        group = group or LearnerGroup(d.learner)
        group.add(d.seq, header, delta)
    if group is not None:
        stream.add(group)
    return stream, ctx.cfg


def replay(ctx: RunContext, chain: list[Manifest], report: AuditReport, keyring=None, start: int = 0,
           checkpoints: dict | None = None) -> None:
    """Recompute every version after `start` from the state replayed so far (from the checkpoint at `start`),
    the parent's guard state, the recorded control ops and the stored deltas: the decisions, the outlier
    statistics, the guard state and the bits — and the stored states (checkpoints) against the replay."""
    def step_inputs(prev: Manifest, m: Manifest, params):
        if m.guard is None:
            return _legacy_stream(ctx, prev, m, params)
        return replay_decisions(ctx, prev, m, params, report, keyring)

    for prev, m, buffers in replay_chain(ctx, chain, start, checkpoints or {}, report, step_inputs):
        _compare_buffers(ctx, prev, m, buffers, report)


def _compare_buffers(ctx: RunContext, prev: Manifest, m: Manifest, merged, report: AuditReport) -> None:
    """The version's buffers object holds the replayed merge of the learners' buffers, bit for bit, or (no
    learner's buffers merged) its parent's bytes."""
    if not ctx.buffers or not m.buffers_key:
        return  # a version without buffers is reported by audit_run
    if merged is None:
        same = m.buffers_checksum == prev.buffers_checksum
    else:
        try:
            _, stored = read_tensors(ctx.store, m.buffers_key, checksum=m.buffers_checksum)
        except (StorageError, CodecError):
            return  # reported by audit_run's checksum check
        same = list(stored) == list(merged) and all(torch.equal(stored[k], merged[k]) for k in merged)
    if not same:
        report.replay_ok = False
        report.problem(f"version {m.version}: replayed buffers differ from the committed ones")


def audit_run(ctx: RunContext, do_replay: bool = True,
              keyring: dict[str, list[bytes]] | None = None) -> AuditReport:
    """Every check on every chain of the run; `keyring` (learner -> keys) lets the replay verify signatures of
    a signed run. num_versions is the run's (the fewest any chain has); a fragmented run's report also lists
    each fragment chain's (fragment_versions)."""
    pinned, pin = pin_state(ctx.store, ctx.keys, ctx.store.get(ctx.keys.run_json()))  # run.json as created
    do_replay = do_replay and pinned  # a changed run.json: replaying another config lists only differences
    torch.set_num_threads(1)  # the merger's reduction order
    report = AuditReport(signatures_verified=keyring is not None and ctx.cfg.learner.sign)
    if ctx.fragments:
        root = list_versions(ctx.store, ctx.keys)
        if root != [0]:
            report.problem(f"root chain of a fragmented run must hold version 0 only, holds {root[:10]}")
    versions = []
    for index, chain in enumerate(chain_contexts(ctx)):
        sub = AuditReport()
        audit_chain(chain, sub, do_replay, keyring)
        report.add(sub, f"fragment {index}: " if ctx.fragments else "")
        versions.append(sub.num_versions)
    report.num_versions = min(versions)
    report.fragment_versions = versions if ctx.fragments else []
    return note_pin(report, pinned, pin)


def audit_chain(ctx: RunContext, report: AuditReport, do_replay: bool = True,
                keyring: dict[str, list[bytes]] | None = None) -> None:
    """Every check on one chain (`ctx`: its context, run/fragments.fragment_context), into `report`: of the
    history the chain keeps (from a retention record's `oldest`, gc's; from version 0 without one)."""
    chain = load_chain(ctx, report)
    kept = read_retention(ctx, report)
    start = kept.oldest if kept is not None else 0
    report.history_from = [start]
    if kept is not None:
        what = "the retention record's checkpoint"
        check_object(ctx, kept.checkpoint_key, kept.checkpoint_checksum, what, report)
    checkpoints = check_state_objects(ctx, chain, start, report)
    check_decisions(ctx, chain, report, start)
    check_controls(ctx, chain, report)
    if do_replay and chain:
        replay(ctx, chain, report, keyring, start, checkpoints)

"""`audit`: prove a run's history — contiguous manifests, checksums, at-most-once merging, every
delta decided, and a bit-for-bit replay of every merge from the stored objects (the merged buffers too) — on every
chain of the run: the root chain of a whole-model run, or each fragment's (the root then holds version 0 only).

Contract: read-only; returns every problem found rather than stopping at the first; one report over the chains
(a fragment chain's problems name their fragment), `ok` only when every chain is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from diloco.inspect.audit_trust import check_controls, replay_decisions
from diloco.merger.step import LearnerGroup, OuterState, gradient_stream, outer_optimizer, outer_step
from diloco.merger.waiting import plausible_ahead
from diloco.run.context import RunContext, direct_names
from diloco.run.fragments import chain_contexts
from diloco.run.objects import read_tensors
from diloco.run.pin import note_pin, pin_state
from diloco.storage import Manifest, StorageError, list_versions, read_manifest
from diloco.storage.codec import CodecError, decode, object_checksum
from diloco.storage.keys import parse_delta_key


@dataclass
class AuditReport:
    ok: bool = True
    num_versions: int = 0
    deltas_merged: int = 0
    deltas_rejected: int = 0
    deltas_lost: int = 0
    deltas_pending: int = 0  # published after the last merge of a run that has ended
    deltas_ignored: int = 0  # keys no merge decides: a name never admitted, a seq further ahead than a learner can be
    decisions_replayed: int = 0  # decisions recomputed from the stored objects and found equal
    decisions_unreplayable: int = 0  # rejected deltas whose object changed or vanished since, or signatures without keys
    signatures_verified: bool = False  # a keyring was at hand (learner.sign runs)
    controls_applied: int = 0  # operator control ops recorded in manifests
    replay_ok: bool = True
    problems: list[str] = field(default_factory=list)
    fragment_versions: list[int] = field(default_factory=list)  # a fragmented run: versions per fragment chain
    run_json: str = ""  # run.json against version 0's pin (diloco.run.pin)

    COUNTS = ("deltas_merged", "deltas_rejected", "deltas_lost", "deltas_pending", "deltas_ignored",
              "decisions_replayed", "decisions_unreplayable", "controls_applied")

    def problem(self, text: str) -> None:
        self.ok = False
        self.problems.append(text)

    def add(self, chain: AuditReport, prefix: str = "") -> None:
        """Fold one chain's report into this one (its problems prefixed, e.g. with its fragment)."""
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + getattr(chain, name))
        self.replay_ok = self.replay_ok and chain.replay_ok
        for text in chain.problems:
            self.problem(prefix + text)

    def to_json(self) -> dict:
        return {"ok": self.ok, "num_versions": self.num_versions, "deltas_merged": self.deltas_merged,
                "deltas_rejected": self.deltas_rejected, "deltas_lost": self.deltas_lost,
                "deltas_pending": self.deltas_pending, "deltas_ignored": self.deltas_ignored,
                "decisions_replayed": self.decisions_replayed,
                "decisions_unreplayable": self.decisions_unreplayable, "signatures_verified": self.signatures_verified,
                "controls_applied": self.controls_applied, "replay_ok": self.replay_ok, "problems": self.problems,
                "run_json": self.run_json,
                **({"fragment_versions": self.fragment_versions} if self.fragment_versions else {})}


def _check_object(ctx: RunContext, key: str, checksum: str, what: str, report: AuditReport) -> bytes | None:
    try:
        data = ctx.store.get(key)
    except StorageError as err:
        report.problem(f"{what}: cannot read {key}: {err}")
        return None
    if object_checksum(data) != checksum:
        report.problem(f"{what}: checksum of {key} does not match the manifest")
        return None
    return data


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
        if m.version != v or (v > 0 and m.parent != v - 1):
            report.problem(f"version {v}: manifest says version {m.version}, parent {m.parent}")
        chain.append(m)
    report.num_versions = len(chain)
    return chain


def check_decisions(ctx: RunContext, chain: list[Manifest], report: AuditReport) -> None:
    decided: dict[tuple[str, int], int] = {}
    ranges: dict[str, list[tuple[int, int]]] = {}  # learner -> (first, last) of each range one decision decided
    cursors: dict[str, int] = {}
    for m in chain:
        for d in m.decisions:
            key = (d.learner, d.seq)
            stranger = d.check == "admission" and d.learner not in cursors  # decided again by a restarted merger
            if key in decided and not stranger:
                report.problem(f"delta {d.learner}/{d.seq} decided twice (versions {decided[key]} and {m.version})")
            decided[key] = m.version
            if d.seq_last is not None:  # one decision for a range: a gap declared lost, a stranger's keys
                ranges.setdefault(d.learner, []).append((d.seq, d.seq_last))
                report.deltas_lost += (d.seq_last - d.seq) if d.status == "lost" else 0
                if d.seq_last < d.seq or not (d.status == "lost" or stranger):
                    report.problem(f"delta {d.learner}/{d.seq}: a range to {d.seq_last} that is neither lost nor "
                                   "a stranger's")
            if d.status == "merged":
                report.deltas_merged += 1
                if d.seq <= cursors.get(d.learner, -1):
                    report.problem(f"delta {d.learner}/{d.seq} merged at or below the cursor in version {m.version}")
                _check_object(ctx, ctx.keys.delta(d.learner, d.seq), d.checksum, f"version {m.version}", report)
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
            report.deltas_ignored += 1  # a stranger's key, or one further ahead than a learner can be: no delta
        elif seq > cursors.get(learner, -1):
            report.deltas_pending += 1
        else:
            report.problem(f"delta {learner}/{seq} is at or below the cursor but was never decided")


def _parent_state(ctx: RunContext, prev: Manifest):
    _, params = read_tensors(ctx.store, prev.params_key, checksum=prev.params_checksum)
    if prev.outer_key:
        _, raw = read_tensors(ctx.store, prev.outer_key, checksum=prev.outer_checksum)
        return params, OuterState.from_tensors(raw, params)
    return params, OuterState.zeros_like(params)


def _legacy_stream(ctx: RunContext, prev: Manifest, m: Manifest, params):
    """A manifest written before the guard (no GuardState): the merged deltas as recorded, run.json's config."""
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


def replay(ctx: RunContext, chain: list[Manifest], report: AuditReport, keyring=None) -> None:
    """Recompute every version from its parent, the parent's outer state and guard state, the recorded
    control ops and the stored deltas: the decisions, the outlier statistics, the guard state and the bits."""
    for prev, m in zip(chain, chain[1:], strict=False):
        try:
            params, outer = _parent_state(ctx, prev)
            if m.guard is None:
                stream, cfg = _legacy_stream(ctx, prev, m, params)
            else:
                stream, cfg = replay_decisions(ctx, prev, m, params, report, keyring)
            result = outer_step(params, outer, stream, ctx.fingerprint, outer_optimizer(cfg, len(ctx.learners)))
        except (StorageError, CodecError, ValueError) as err:
            report.replay_ok = False
            report.problem(f"version {m.version}: replay could not read its inputs: {err}")
            continue
        _compare_replay(ctx, m, result, report)
        _compare_buffers(ctx, prev, m, result.buffers, report)


def same_update(ctx: RunContext, m: Manifest, replayed: bytes) -> bool:
    """The replayed update is the committed one: the same bytes, or (when a zstd of another version packs the
    same frames differently) the same header and the same values, bit for bit."""
    if object_checksum(replayed) == m.update_checksum:
        return True
    try:
        h1, ours = decode(replayed)
        h2, theirs = decode(ctx.store.get(m.update_key))
    except (StorageError, CodecError):  # the stored object's own problem is reported by _check_object
        return False
    return (h1.codec, h1.meta, h1.tensors) == (h2.codec, h2.meta, h2.tensors) and \
        all(np.array_equal(ours[k], theirs[k]) for k in ours)


def _compare_replay(ctx: RunContext, m: Manifest, result, report: AuditReport) -> None:
    if not same_update(ctx, m, result.update_bytes):
        report.replay_ok = False
        report.problem(f"version {m.version}: replayed update differs from the committed one")
        return
    _, stored = read_tensors(ctx.store, m.params_key, checksum=m.params_checksum)
    if any(not torch.equal(stored[k], result.params[k]) for k in stored):
        report.replay_ok = False
        report.problem(f"version {m.version}: replayed parameters differ from the committed ones")
        return
    _, raw = read_tensors(ctx.store, m.outer_key, checksum=m.outer_checksum)
    if any(not torch.equal(raw[k], v) for k, v in result.outer.to_tensors().items()):
        report.replay_ok = False
        report.problem(f"version {m.version}: replayed outer state differs from the committed one")


def _compare_buffers(ctx: RunContext, prev: Manifest, m: Manifest, merged, report: AuditReport) -> None:
    """The version's buffers object holds the replayed merge of the learners' buffers, bit for bit, or (no learner's
    buffers merged) its parent's bytes."""
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


def audit_run(ctx: RunContext, do_replay: bool = True, keyring: dict[str, list[bytes]] | None = None) -> AuditReport:
    """Every check on every chain of the run; `keyring` (learner -> keys) lets the replay verify signatures of a
    signed run. num_versions is the run's (the fewest any chain has); a fragmented run's report also lists each
    fragment chain's (fragment_versions)."""
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
    """Every check on one chain (`ctx`: its context, run/fragments.fragment_context), into `report`."""
    chain = load_chain(ctx, report)
    for m in chain:
        _check_object(ctx, m.params_key, m.params_checksum, f"version {m.version} params", report)
        if m.version > 0:
            _check_object(ctx, m.update_key, m.update_checksum, f"version {m.version} update", report)
        if m.buffers_key:
            _check_object(ctx, m.buffers_key, m.buffers_checksum, f"version {m.version} buffers", report)
        elif ctx.buffers:
            report.problem(f"version {m.version}: no buffers object, where the run merges {len(ctx.buffers)} buffers")
    check_decisions(ctx, chain, report)
    check_controls(ctx, chain, report)
    if do_replay:
        replay(ctx, chain, report, keyring)

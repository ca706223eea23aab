"""Garbage collection of a run's chains: orphans (always), and retention (`diloco gc --keep-versions N` or
`--before V`, off by default) — what no kept version needs any more (docs/STORAGE.md, "Retention").

Contract: orphans are objects no manifest names — under global/ (a crashed merge's or a race loser's update)
and guard/ (its outlier window), and checkpoint folders that are neither complete nor the state of a committed
version (a writer killed mid-part) — older than `min_age_s`, so a live merger's objects for the version it is
about to commit (or a checkpoint it is writing) are never taken. Retention keeps the history from the
checkpoint the oldest kept version names (every checkpoint, update and merged delta after it; every manifest
and window), so the newest checkpoint's chain and every kept version's rebuild are never broken; it writes the
chain's retention record (where the kept history starts) before it deletes anything, so `audit` covers what is
kept, and a gc stopped half-way leaves only less to delete.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from diloco.run.checkpoint import manifest_checksum
from diloco.run.context import RunContext
from diloco.run.controls import operator_identity
from diloco.run.fragments import chain_contexts, fragment_context, manifests
from diloco.storage import Manifest, NotFound, StorageError
from diloco.storage.keys import parse_checkpoint_key, parse_delta_key, parse_heads_key
from diloco.storage.records import CheckpointRecord, RecordError, RetentionRecord, read_record, write_record

DEFAULT_MIN_AGE_S = 600.0  # far longer than any merge takes to go from its first object to its manifest


@dataclass
class GcReport:
    referenced: int = 0
    orphans: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    too_young: list[str] = field(default_factory=list)
    retained: list[str] = field(default_factory=list)  # retention: what it removed (or would, dry)
    retained_bytes: int = 0
    history_from: list[int] = field(default_factory=list)  # per chain: the oldest version whose state is kept


def collect_orphans(ctx: RunContext, *, min_age_s: float = DEFAULT_MIN_AGE_S, dry_run: bool = False,
                    now: float | None = None) -> GcReport:
    """The orphans of the run's chain, or of every chain of a fragmented run (the root's and each
    fragment's)."""
    # the root chain (reads keys, not fragments)
    report = _collect_chain(ctx, GcReport(), min_age_s, dry_run, now)
    for index in range(len(ctx.fragments)):
        report = _collect_chain(fragment_context(ctx, index), report, min_age_s, dry_run, now)
    return report


def _referenced(ctx: RunContext, chain: list[Manifest]) -> set[str]:
    keys = set()
    for m in chain:
        keys.update(k for k in (m.params_key, m.update_key, m.outer_key, m.buffers_key) if k)
        if m.checkpoint is not None:
            keys.add(m.checkpoint.key)
        if m.guard is not None and m.guard.window is not None:
            keys.add(m.guard.window.key)
    with contextlib.suppress(NotFound, RecordError):
        keys.add(read_record(ctx.store, ctx.keys.retention(), RetentionRecord).checkpoint_key)
    return keys


def _complete_checkpoints(ctx: RunContext, keys: list[str], referenced: set[str]) -> set[str]:
    """The folders of the chain's checkpoints that are named, or complete and the state of a committed
    version."""
    kept = set()
    for key in keys:
        parsed = parse_checkpoint_key(key)
        if parsed is None or parsed[2] != "checkpoint.json":
            continue
        folder = key.rpartition("/")[0] + "/"
        if key in referenced:
            kept.add(folder)
            continue
        try:
            record = CheckpointRecord.from_bytes(ctx.store.get(key), key=key)
            if record.manifest_checksum and record.manifest_checksum == manifest_checksum(ctx, parsed[0]):
                kept.add(folder)
        except (NotFound, RecordError):
            continue
    return kept


def _collect_chain(ctx: RunContext, report: GcReport, min_age_s: float, dry_run: bool,
                   now: float | None) -> GcReport:
    referenced = _referenced(ctx, manifests(ctx))
    report.referenced += len(referenced)
    now = time.time() if now is None else now
    checkpoint_keys = ctx.store.list(ctx.keys.checkpoints_prefix())
    complete = _complete_checkpoints(ctx, checkpoint_keys, referenced)
    listed = ctx.store.list(ctx.keys.global_prefix()) + ctx.store.list(ctx.keys.guard_prefix())
    candidates = [k for k in listed if k not in referenced and parse_heads_key(k) is None]  # heads: no orphan
    candidates += [k for k in checkpoint_keys if k.rpartition("/")[0] + "/" not in complete]
    for key in candidates:
        report.orphans.append(key)
        try:
            age = now - ctx.store.modified(key)
        except (NotFound, StorageError):
            continue
        if age < min_age_s:
            report.too_young.append(key)
        elif not dry_run:
            ctx.store.delete(key)
            report.deleted.append(key)
    return report


def retain(ctx: RunContext, *, keep_versions: int | None = None, before: int | None = None,
           dry_run: bool = False, by: str | None = None) -> GcReport:
    """Retention on every chain of the run: keep the newest `keep_versions` versions (or every version from
    `before` on) rebuildable, and remove what only older ones need. ValueError for a bad bound."""
    if (keep_versions is None) == (before is None):
        raise ValueError("retention needs exactly one of --keep-versions N (>= 1) or --before V (>= 0)")
    if (keep_versions is not None and keep_versions < 1) or (before is not None and before < 0):
        raise ValueError("--keep-versions must be >= 1 and --before >= 0")
    report, by = GcReport(), by or operator_identity()
    for chain in chain_contexts(ctx):
        _retain_chain(chain, report, keep_versions, before, dry_run, by)
    return report


def _retain_chain(ctx: RunContext, report: GcReport, keep_versions: int | None, before: int | None,
                  dry_run: bool, by: str) -> None:
    chain = manifests(ctx)
    if not chain:
        return
    newest = chain[-1].version
    first_kept = max(0, newest - keep_versions + 1) if keep_versions is not None else min(before, newest)
    oldest = chain[first_kept].state_version  # the checkpoint the oldest kept version is rebuilt from
    try:
        previous = read_record(ctx.store, ctx.keys.retention(), RetentionRecord)
    except NotFound:
        previous = None
    if previous is not None and previous.oldest >= oldest:
        report.history_from.append(previous.oldest)
        return
    report.history_from.append(oldest)
    doomed = _doomed(ctx, chain, oldest)
    sizes = ctx.store.sizes(ctx.keys.chain_root + "/")
    gone = [k for k in doomed if k in sizes]
    report.retained += gone
    report.retained_bytes += sum(sizes[k] for k in gone)
    if dry_run:
        return
    ref = chain[first_kept].checkpoint if not chain[first_kept].params_key else None  # the one at `oldest`
    removed = sum(sizes[k] for k in gone)
    record = RetentionRecord(oldest=oldest, checkpoint_key=ref.key if ref else chain[oldest].params_key,
                             checkpoint_checksum=ref.checksum if ref else chain[oldest].params_checksum,
                             t=time.time(), by=by,
                             removed_objects=(previous.removed_objects if previous else 0) + len(gone),
                             removed_bytes=(previous.removed_bytes if previous else 0) + removed)
    write_record(ctx.store, ctx.keys.retention(), record)  # first: audit starts there if gc stops half-way
    for key in gone:
        ctx.store.delete(key)
        report.deleted.append(key)


def _doomed(ctx: RunContext, chain: list[Manifest], oldest: int) -> list[str]:
    """What no version from `oldest` on needs: checkpoints before it, updates and per-version objects at or
    before it (its own state is its checkpoint's), and the deltas (and signatures) decided at or before it."""
    out = []
    for key in ctx.store.list(ctx.keys.checkpoints_prefix()):
        parsed = parse_checkpoint_key(key)
        if parsed is not None and parsed[0] < oldest:
            out.append(key)
    decided: dict[str, list[tuple[int, int]]] = {}  # learner -> (first, last) seqs of each decision
    for m in chain[:oldest + 1]:
        own = m.version == oldest  # version oldest's own objects stay (a schema-1 version's state; buffers)
        out += [k for k in (m.params_key, m.outer_key, m.buffers_key) if k and not own]
        out += [m.update_key] if m.update_key else []  # every reader from `oldest` on starts at a checkpoint
        for d in m.decisions:
            decided.setdefault(d.learner, []).append((d.seq, d.last_seq))
    for key in ctx.store.list(ctx.keys.deltas_prefix()):
        parsed = parse_delta_key(key.removesuffix(".sig") + ".delta" if key.endswith(".sig") else key)
        if parsed is not None and any(a <= parsed[1] <= b for a, b in decided.get(parsed[0], ())):
            out.append(key)
    return out

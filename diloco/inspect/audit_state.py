"""The audit of a chain's state objects and of its replay: every checkpoint and update the chain keeps matches
its checksums, the manifests name checkpoints by the log's invariants, and the replay of every merge from
the oldest kept checkpoint reproduces every committed update — and, at every checkpoint, the params and
outer state — bit for bit (docs/STORAGE.md, "Invariants").

Contract: read-only; problems go to the report (diloco.inspect.audit.AuditReport). The history before a
retention record's `oldest` (`diloco gc --keep-versions`) is not checked: its objects may be gone; the
record says where the kept history starts, and the replay starts at the checkpoint it names (checked
against its recorded checksum).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from diloco.configs import checkpoint_every
from diloco.merger.checkpointer import K_MAX_FACTOR
from diloco.merger.inplace import outer_step_in_place
from diloco.merger.replay import ChainState, recover, same_update
from diloco.merger.step import outer_optimizer
from diloco.run.checkpoint import manifest_checksum, read_checkpoint
from diloco.run.context import RunContext
from diloco.run.objects import CorruptObject, read_tensors
from diloco.storage import Manifest, NotFound, StorageError
from diloco.storage.codec import CodecError, object_checksum
from diloco.storage.keys import parse_checkpoint_key
from diloco.storage.manifest import CheckpointRef
from diloco.storage.records import CheckpointRecord, RecordError, RetentionRecord, read_record


def read_retention(ctx: RunContext, report: Any) -> RetentionRecord | None:
    """The chain's retention record (None: every version's history is kept)."""
    try:
        return read_record(ctx.store, ctx.keys.retention(), RetentionRecord)
    except NotFound:
        return None
    except RecordError as err:
        report.problem(f"retention record unreadable: {err}")
        return None


def check_object(ctx: RunContext, key: str, checksum: str, what: str, report: Any) -> bytes | None:
    try:
        data = ctx.store.get(key)
    except StorageError as err:
        report.problem(f"{what}: cannot read {key}: {err}")
        return None
    if object_checksum(data) != checksum:
        report.problem(f"{what}: checksum of {key} does not match the manifest")
        return None
    return data


def _check_checkpoint(ctx: RunContext, ref: CheckpointRef, report: Any) -> bool:
    """A checkpoint's JSON against its checksum, and every part against the JSON."""
    data = check_object(ctx, ref.key, ref.checksum, f"checkpoint of version {ref.version}", report)
    if data is None:
        return False
    try:
        record = CheckpointRecord.from_bytes(data, key=ref.key)
    except RecordError as err:
        report.problem(f"checkpoint of version {ref.version}: {err}")
        return False
    ok = record.version == ref.version and record.fingerprint == ctx.fingerprint
    if not ok:
        report.problem(f"checkpoint {ref.key} says version {record.version}, "
                       f"fingerprint {record.fingerprint}")
    for index, part in enumerate(record.parts):
        what = f"checkpoint {ref.version} part {index}"
        ok = check_object(ctx, part.key, part.checksum, what, report) is not None and ok
    return ok


def listed_checkpoints(ctx: RunContext, chain: list[Manifest], start: int,
                       report: Any) -> dict[int, CheckpointRef]:
    """Every complete checkpoint of the chain at or after `start` (named by a manifest, or found by listing:
    one that landed after the newest commit, or was never named), checked; version -> its reference."""
    by_version = {m.version: m for m in chain}
    found: dict[int, CheckpointRef] = {}
    for key in ctx.store.list(ctx.keys.checkpoints_prefix()):
        parsed = parse_checkpoint_key(key)
        if parsed is None or parsed[2] != "checkpoint.json" or not start <= parsed[0] or \
                parsed[0] not in by_version:
            continue
        try:
            data = ctx.store.get(key)
            record = CheckpointRecord.from_bytes(data, key=key)
        except (StorageError, RecordError) as err:
            report.problem(f"checkpoint {key} unreadable: {err}")
            continue
        ref = CheckpointRef(version=parsed[0], key=key, checksum=object_checksum(data))
        named = any(m.checkpoint == ref for m in chain)
        if not named and record.manifest_checksum != manifest_checksum(ctx, parsed[0]):
            report.checkpoints_unnamed += 1  # no committed version's state (a writer's leftover): unused
            continue
        if _check_checkpoint(ctx, ref, report):
            found[ref.version] = ref
    return found


def check_state_objects(ctx: RunContext, chain: list[Manifest], start: int,
                        report: Any) -> dict[int, CheckpointRef]:
    """Updates, schema-1 state objects and buffers of the kept history; every manifest's checkpoint reference
    by the invariants (at or before its version, never older than its parent's, at most K_MAX_FACTOR x K
    behind); returns the checked checkpoints by version."""
    checkpoints = listed_checkpoints(ctx, chain, start, report)
    every, named = checkpoint_every(ctx.cfg), -1
    for m in chain:
        if m.version < start:
            continue
        if m.params_key:
            check_object(ctx, m.params_key, m.params_checksum, f"version {m.version} params", report)
        if m.version > start:
            check_object(ctx, m.update_key, m.update_checksum, f"version {m.version} update", report)
        if m.buffers_key:
            check_object(ctx, m.buffers_key, m.buffers_checksum, f"version {m.version} buffers", report)
        elif ctx.buffers:
            report.problem(f"version {m.version}: no buffers object, where the run merges "
                           f"{len(ctx.buffers)} buffers")
        ref = m.checkpoint
        if ref is None:
            continue
        if not named <= ref.version <= m.version:
            report.problem(f"version {m.version} names checkpoint {ref.version}: not between its parent's "
                           f"({named}) and itself")
        elif m.version - ref.version > K_MAX_FACTOR * every and named >= 0:
            report.problem(f"version {m.version} names checkpoint {ref.version}: more than {K_MAX_FACTOR} x "
                           f"state.checkpoint_every ({every}) behind")
        if ref.version >= start and checkpoints.get(ref.version) != ref:
            report.problem(f"version {m.version} names checkpoint {ref.key}, which is missing or damaged")
        named = max(named, ref.version)
    return checkpoints


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def compare_state(ctx: RunContext, m: Manifest, params, outer, checkpoints: dict[int, CheckpointRef],
                  report: Any) -> bool:
    """The replayed state of m's version against what the chain stored of it: its checkpoint, or its schema-1
    params and outer objects; False (a problem reported) when they differ."""
    stored = None
    if m.params_key:
        _, p = read_tensors(ctx.store, m.params_key, checksum=m.params_checksum)
        raw = read_tensors(ctx.store, m.outer_key, checksum=m.outer_checksum)[1] if m.outer_key else None
        stored = ("params and outer state", p, raw)
    elif m.version in checkpoints:
        got = read_checkpoint(ctx, checkpoints[m.version], outer=True)
        stored = (f"checkpoint {checkpoints[m.version].key}", got.params,
                  got.outer.to_tensors() if got.outer is not None else None)
    if stored is None:
        return True
    what, p, raw = stored
    mine = outer.to_tensors() if outer is not None else None
    zeros = mine is None or all(not bool(t.any()) for t in mine.values())
    if not _same(p, params) or (raw is None and not zeros) or (raw is not None and (mine is None or not
                                                                                    _same(raw, mine))):
        report.replay_ok = False
        report.problem(f"version {m.version}: the replayed state differs from its stored {what}")
        return False
    report.checkpoints_compared += 1
    return True


def start_state(ctx: RunContext, m: Manifest, checkpoints: dict[int, CheckpointRef]) -> ChainState:
    """The state the replay starts from at m's version: its schema-1 objects, or its checkpoint."""
    if m.params_key or m.version not in checkpoints:
        return recover(ctx, m, newest=False)
    got = read_checkpoint(ctx, checkpoints[m.version], outer=True)
    return ChainState(m, got.params, got.outer, got.ema, checkpoint=checkpoints[m.version])


def replay_chain(ctx: RunContext, chain: list[Manifest], start: int, checkpoints: dict[int, CheckpointRef],
                 report: Any, step_inputs: Callable) -> Iterator[tuple[Manifest, Manifest, Any]]:
    """Every merge from `start` on, re-judged (`step_inputs(prev, m, params)`: the stream and config,
    audit_trust's) and stepped on the replayed state; each update against the committed one, each stored
    state against the replay; yields (parent, manifest, merged buffers) of every version replayed. After a
    difference the replay goes on from the next version that stores its state."""
    state: ChainState | None = None
    for index in range(start, len(chain)):
        m = chain[index]
        if state is None:
            if m.version != start and not (m.params_key or m.version in checkpoints):
                continue  # resyncing: no stored state here
            try:
                state = start_state(ctx, m, checkpoints)
            except (StorageError, CodecError, CorruptObject, ValueError) as err:
                report.replay_ok = False
                report.problem(f"version {m.version}: the replay cannot start here: {err}")
            continue
        prev = chain[index - 1]
        try:
            stream, cfg = step_inputs(prev, m, state.params)
            result = outer_step_in_place(state.params, state.outer, stream, ctx.fingerprint,
                                         outer_optimizer(cfg, len(ctx.learners)))
        except (StorageError, CodecError, ValueError) as err:
            report.replay_ok = False
            report.problem(f"version {m.version}: replay could not read its inputs: {err}")
            state = None
            continue
        if not same_update(ctx, m, result.update_bytes):
            report.replay_ok = False
            report.problem(f"version {m.version}: replayed update differs from the committed one")
            state = None
            continue
        report.versions_replayed += 1
        state = ChainState(m, result.params, result.outer, {})
        if not compare_state(ctx, m, state.params, state.outer, checkpoints, report):
            state = None
        yield prev, m, result.buffers

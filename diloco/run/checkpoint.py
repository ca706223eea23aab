"""A chain's checkpoint: its params and outer state at one version, in parts of bounded size listed by one
small JSON (docs/STORAGE.md, "Checkpoints"), DCP-style.

Contract: `write_checkpoint` puts every part first — an fp32 tensor object of flat slices of the state's
tensors (byte-shuffled, zstd frames), hashed while it is put — and the JSON last: a checkpoint exists once
its JSON does, and a failure leaves parts that nothing names (gc's orphans). One part's bytes are built at
a time, so no object is ever the whole state in memory, a tensor larger than a part splits over parts, and
a failed put costs one part. `read_checkpoint` checks the JSON against the checksum its reader holds (a
manifest's reference), each part against the JSON and the slices against each other: CorruptObject names
what fails. Checkpoints are immutable (nonce-named, never overwritten) and monotone along a chain (a
manifest names one at or before its version, never older than its parent's).
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diloco.run.context import RunContext
from diloco.run.objects import CorruptObject, put_checksummed, read_ahead, read_checked, read_committed
from diloco.storage import Manifest, NotFound
from diloco.storage.codec import CodecError, Encoder, object_checksum
from diloco.storage.codec.payload import zstd_available
from diloco.storage.keys import new_nonce, parse_checkpoint_key
from diloco.storage.manifest import CheckpointRef
from diloco.storage.records import CheckpointPart, CheckpointRecord, RecordError, RetentionRecord, read_record
from diloco.training.outer import OuterState
from diloco.training.tensors import Tensors

PART_BYTES = 64 << 20  # fp32 bytes of state per part (at most 1 GiB): the writer holds about two parts' bytes
StageHook = Callable[[str], None]


@dataclass
class ChainCheckpoint:
    """A checkpoint as read: the chain's params at `version`, and (when asked for) its outer state."""

    version: int
    params: Tensors
    outer: OuterState | None  # None: not read, or the checkpoint holds none (zeros: version 0)
    ema: dict[str, float]
    ref: CheckpointRef
    record: CheckpointRecord


def state_tensors(params: Tensors, outer: OuterState | None) -> list[tuple[str, torch.Tensor]]:
    """The state's tensors in checkpoint order: params/<p>, then momentum/<p>, residual/<p> (pending/<p>)."""
    out = [(f"params/{k}", v) for k, v in params.items()]
    if outer is not None:
        out += [(f"momentum/{k}", outer.momentum[k]) for k in params]
        out += [(f"residual/{k}", outer.residual[k]) for k in params]
        out += [(f"pending/{k}", outer.pending[k]) for k in params if outer.pending]
    return out


def plan_parts(shapes: list[tuple[str, int]], part_elements: int) -> list[list[tuple[str, int, int]]]:
    """Flat slices (tensor, start, stop) packed in order into parts of at most `part_elements` elements; a
    tensor larger than a part's room splits over parts (an empty tensor is one empty slice)."""
    parts: list[list[tuple[str, int, int]]] = [[]]
    room = part_elements
    for name, numel in shapes:
        if numel == 0:
            parts[-1].append((name, 0, 0))
            continue
        start = 0
        while start < numel:
            if room == 0:
                parts.append([])
                room = part_elements
            take = min(room, numel - start)
            parts[-1].append((name, start, start + take))
            start, room = start + take, room - take
    return [p for p in parts if p]


def write_checkpoint(ctx: RunContext, version: int, params: Tensors, outer: OuterState | None, *,
                     ema: dict[str, float], manifest_checksum: str, created_by: str,
                     stage_hook: StageHook | None = None, on_encoded: Callable[[], None] | None = None,
                     part_bytes: int | None = None) -> CheckpointRef:
    """Write the chain's state at `version` (params, and the outer state unless None) as a checkpoint; returns
    the reference a manifest names it by. `on_encoded` is called once every part's bytes are built (the
    state may change after that: the puts of the last parts copy nothing from it); `stage_hook` sees
    `checkpoint_part` after each part and `checkpoint_written` after the JSON (chaos: a kill there)."""
    hook = stage_hook or (lambda stage: None)
    tensors = state_tensors(params, outer)
    by_name = dict(tensors)
    elements = max(1, (part_bytes or PART_BYTES) // 4)
    # the params and the outer state never share a part: a reader of the params alone (a learner, the
    # evaluator, export) reads no outer-state bytes, also when a small fragment's whole state fits one part
    shapes = [(name, t.numel()) for name, t in tensors]
    plan = plan_parts([s for s in shapes if s[0].startswith("params/")], elements) \
        + plan_parts([s for s in shapes if not s[0].startswith("params/")], elements)
    nonce, parts = new_nonce(), []
    compression = "zstd" if zstd_available() else "lz4"
    for index, slices in enumerate(plan):
        encoder = Encoder(codec="fp32", kind="checkpoint", fingerprint=ctx.fingerprint,
                          compression=compression, meta={"version": version, "part": index})
        for name, start, stop in slices:
            encoder.add(f"{name}[{start}:{stop}]", by_name[name].detach().reshape(-1)[start:stop].numpy())
        data = encoder.finish()
        if index == len(plan) - 1 and on_encoded is not None:
            on_encoded()  # the bytes of every part are built: the state is free to change
        key = ctx.keys.checkpoint_part(version, nonce, index)
        parts.append(CheckpointPart(key=key, checksum=put_checksummed(ctx.store, key, data), bytes=len(data),
                                    slices=slices))
        del data, encoder
        hook("checkpoint_part")
    record = CheckpointRecord(
        run_id=ctx.run_id, fragment=ctx.keys.fragment, version=version, created_at=time.time(),
        created_by=created_by or socket.gethostname(), fingerprint=ctx.fingerprint,
        manifest_checksum=manifest_checksum, tensors=[(name, list(t.shape)) for name, t in tensors],
        parts=parts, outer=outer is not None, pending_share=outer.pending_share if outer is not None else 0.0,
        ema=dict(ema))
    key = ctx.keys.chain_checkpoint(version, nonce)
    data = record.to_bytes()
    ctx.store.put(key, data)
    hook("checkpoint_written")
    return CheckpointRef(version=version, key=key, checksum=object_checksum(data))


def read_record_checked(ctx: RunContext, ref: CheckpointRef) -> CheckpointRecord:
    """The checkpoint's JSON, checked against the reference's checksum and the chain (CorruptObject
    otherwise)."""
    what = f"checkpoint {ref.key}"
    for _ in range(3):
        try:
            record = CheckpointRecord.from_bytes(read_checked(ctx.store, ref.key, ref.checksum), key=ref.key)
            break
        except (CodecError, RecordError) as err:
            failure = str(err)
    else:
        raise CorruptObject(f"{what} is corrupt ({failure}); `diloco audit` names every corrupt "
                            "object") from None
    if (record.run_id, record.fragment, record.version, record.fingerprint) != \
            (ctx.run_id, ctx.keys.fragment, ref.version, ctx.fingerprint):
        raise CorruptObject(f"{what} holds run {record.run_id} fragment {record.fragment} version "
                            f"{record.version} (fingerprint {record.fingerprint}), not this chain's version "
                            f"{ref.version}")
    return record


def read_checkpoint(ctx: RunContext, ref: CheckpointRef, *, outer: bool = True) -> ChainCheckpoint:
    """The checkpoint's params (and, `outer`, its outer state: zeros' None when it holds none), every part
    checked. Only the parts holding params are read when `outer` is False (the params come first)."""
    record = read_record_checked(ctx, ref)
    shapes = dict(record.tensors)
    wanted = {name for name in shapes if outer or name.startswith("params/")}
    # a tensor a part holds whole is the decoded tensor itself (no copy); one split over parts is filled
    out: Tensors = {}
    filled = dict.fromkeys(wanted, 0)
    parts = [(i, part) for i, part in enumerate(record.parts)
             if any(name in wanted for name, _, _ in part.slices)]

    def fetch(i: int, part: CheckpointPart) -> Tensors:
        return read_committed(ctx.store, part.key, checksum=part.checksum, fingerprint=ctx.fingerprint,
                              what=f"checkpoint {ref.key}'s part {i}")[1]

    # the next part is read and decoded on a second thread while this one is taken or copied
    for (index, part), got in read_ahead(parts, lambda p: fetch(*p), "checkpoint-read"):
        names = [f"{name}[{start}:{stop}]" for name, start, stop in part.slices]
        if list(got) != names:
            raise CorruptObject(f"checkpoint {ref.key}'s part {index} holds {list(got)[:4]}, not "
                                f"{names[:4]}")
        for (name, start, stop), value in zip(part.slices, got.values(), strict=True):
            if name not in wanted:
                continue
            shape = shapes[name]
            if value.numel() != stop - start or not 0 <= start <= stop <= math.prod(shape):
                raise CorruptObject(f"checkpoint {ref.key}'s part {index}: {name}[{start}:{stop}] holds "
                                    f"{value.numel()} values of a tensor of {math.prod(shape)}")
            if name not in out and start == 0 and stop == math.prod(shape):
                out[name] = value.reshape(shape)
            else:
                if name not in out:
                    out[name] = torch.empty(shape, dtype=torch.float32)
                out[name].view(-1)[start:stop] = value.reshape(-1)
            filled[name] += stop - start
        del got
    short = [n for n, count in filled.items() if count != math.prod(shapes[n])]
    if short:
        raise CorruptObject(f"checkpoint {ref.key}: its parts do not cover {short[:4]}")
    # the record's order (a tensor of no elements that no part names is still there, empty)
    out = {name: out[name] if name in out else torch.empty(shape, dtype=torch.float32)
           for name, shape in shapes.items() if name in wanted}
    params = {name.removeprefix("params/"): t for name, t in out.items() if name.startswith("params/")}
    state = None
    if outer and record.outer:
        def part_of(prefix: str) -> Tensors:
            return {k: out[f"{prefix}/{k}"] for k in params if f"{prefix}/{k}" in out}

        state = OuterState(part_of("momentum"), part_of("residual"), part_of("pending"), record.pending_share)
    return ChainCheckpoint(ref.version, params, state, dict(record.ema), ref, record)


def manifest_checksum(ctx: RunContext, version: int) -> str:
    """The BLAKE2b of version `version`'s manifest bytes, as a checkpoint of that version records it."""
    return object_checksum(ctx.store.get(ctx.keys.manifest(version)))


def newer_checkpoint(ctx: RunContext, manifest: Manifest) -> CheckpointRef | None:
    """The newest complete checkpoint at or before `manifest`'s version that is newer than the one it names
    (one landed after its commit, or a merger's last), or None: one listing after the named one (S3's
    StartAfter), so O(checkpoints after it); a checkpoint whose JSON does not record this version's
    manifest is not taken."""
    named = manifest.state_version
    prefix = ctx.keys.checkpoints_prefix()
    found: list[tuple[int, str]] = []
    for key in ctx.store.list(prefix, after=f"{prefix}{named:020d}~"):
        parsed = parse_checkpoint_key(key)
        if parsed is not None and parsed[2] == "checkpoint.json" and named < parsed[0] <= manifest.version:
            found.append((parsed[0], key))
    for version, key in sorted(found, reverse=True):
        try:
            data = ctx.store.get(key)
            record = CheckpointRecord.from_bytes(data, key=key)
            expected = manifest_checksum(ctx, version)
        except (NotFound, RecordError):
            continue
        if record.manifest_checksum == expected and record.version == version:
            return CheckpointRef(version=version, key=key, checksum=object_checksum(data))
    return None


def checkpoint_of(ctx: RunContext, manifest: Manifest, *, newest: bool = False) -> CheckpointRef | None:
    """The checkpoint a reader of `manifest`'s version starts from: the one it names, or (`newest`: a reader
    of the newest version, where one may have landed since) a newer one found by newer_checkpoint. None for
    a manifest that names its params itself (schema 1)."""
    if manifest.params_key:
        return None
    if newest:
        found = newer_checkpoint(ctx, manifest)
        if found is not None:
            return found
    return manifest.checkpoint


def read_start(ctx: RunContext, manifest: Manifest, *, outer: bool, newest: bool = False,
               ref: CheckpointRef | None = None) -> ChainCheckpoint:
    """The checkpoint a reader of `manifest`'s version (schema 2) starts from, read: the one it names (or,
    `newest`, a newer one; `ref`: checkpoint_of's answer, when the caller asked it already), or — when gc's
    retention removed that one — the chain's kept history's first checkpoint, if it is at or before the
    version. NotFound when the version's history was removed."""
    ref = ref or checkpoint_of(ctx, manifest, newest=newest)
    try:
        return read_checkpoint(ctx, ref, outer=outer)
    except NotFound:
        try:
            kept = read_record(ctx.store, ctx.keys.retention(), RetentionRecord)
        except (NotFound, RecordError):
            raise NotFound(f"{ref.key}: the checkpoint version {manifest.version} names is gone") from None
        if not ref.version < kept.oldest <= manifest.version:
            raise NotFound(f"version {manifest.version} of run {ctx.run_id}: removed by gc's retention (the "
                           f"chain's history is kept from version {kept.oldest})") from None
        start = CheckpointRef(version=kept.oldest, key=kept.checkpoint_key, checksum=kept.checkpoint_checksum)
        return read_checkpoint(ctx, start, outer=outer)

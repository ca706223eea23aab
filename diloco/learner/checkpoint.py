"""A learner's bucket checkpoint, for a lost host (a crashed process resumes from its local state instead):
after every delta a small pointer (seq, inner step, data cursor, base version) naming the newest moments, and
the optimizer's moments themselves every `learner.checkpoint_every` (C phases, or a time budget such as
"30m"), under fresh keys, optionally quantized (`learner.checkpoint_moments: int8`: block int8 exp_avg,
sqrt-domain int8 exp_avg_sq read back rounded up, so a resumed step is never larger than the exact one).

Contract: the moments are encoded on the training thread from the live optimizer state, one state tensor at a
time, into spool files on this host (a consistent snapshot, no copy held in memory); the publisher uploads
them after the delta, then the pointer (the commit: a pointer names only parts that landed before it), then
deletes parts older than the previous generation. Nothing is overwritten in place but the pointer (a few KB,
read whole by one GET: never a mix of two versions). `read_checkpoint` follows the pointer (or, in a run made
before, reads the single object `checkpoint/state`) and decodes the moments one part at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from diloco.configs.schema import checkpoint_cadence
from diloco.learner.spill import scratch_dir
from diloco.run.events import EventLog
from diloco.run.objects import decode_tensors, read_checked
from diloco.storage import NotFound, StorageError
from diloco.storage.codec import Encoder, object_checksum
from diloco.storage.codec.lazy import LazyObject
from diloco.storage.keys import RunKeys
from diloco.storage.records import Record, RecordError, read_record
from diloco.storage.store import Store

log = logging.getLogger("diloco.learner")
POINTER = "pointer.json"  # learners/<l>/checkpoint/pointer.json: overwritten after every delta (small)
LEGACY = "state"  # learners/<l>/checkpoint/state: the single overwritten object of runs made before
PART_RE = re.compile(r"^m\d{12}-[0-9a-f]{8}\.p\d{4}$")  # a moments part: m<seq>-<nonce>.p<index>
QUANTIZED = {"exp_avg": "int8", "exp_avg_sq": "int8"}  # int8 moments; exp_avg_sq stored as its square root
SQRT_KEYS = ("exp_avg_sq",)
INT8_LEVELS = 127


class MomentsPart(Record):
    key: str
    bytes: int
    checksum: str
    names: list[str]  # its tensors ("<state key>/<param>"), in order


class MomentsRef(Record):
    """One generation of moments: its parts, and the optimizer's meta (scalars, steps) at the time."""

    seq: int  # the delta it was written after
    step: int
    encoding: str  # fp32 | int8
    optimizer: dict[str, Any]
    parts: list[MomentsPart]
    written_at: float


class CheckpointPointer(Record):
    what = "checkpoint pointer"
    format: int = 1
    learner: str
    seq: int  # the delta this pointer follows
    step: int
    cursor: int
    base_version: int
    moments: MomentsRef | None = None  # None: none written yet (a resume starts the optimizer fresh)
    written_at: float = Field(default_factory=time.time)


@dataclass
class CheckpointUpload:
    """What the publisher writes after a delta (or alone): the moments' spool files (maybe none), then the
    pointer, then it deletes the parts older than the previous generation."""

    pointer: CheckpointPointer
    spool: list[tuple[str, Path]] = field(default_factory=list)  # (part key, spool file) to upload, in order
    keep: set[str] = field(default_factory=set)  # part keys the deletion keeps (the previous generation)
    folder: str = ""  # learners/<l>/checkpoint/

    def upload(self, store: Store, put: Callable[[str, bytes], bool], events: EventLog) -> bool:
        """Every part, then the pointer (each through `put`, the publisher's retrying put); False when one
        did not land (nothing is pointed at then). The spool files are removed either way."""
        t0, moments_bytes = time.time(), 0
        try:
            for key, path in self.spool:
                data = path.read_bytes()
                if not put(key, data):
                    return False
                moments_bytes += len(data)
                path.unlink(missing_ok=True)
            pointer = self.pointer.to_bytes()
            if not put(f"{self.folder}{POINTER}", pointer):
                return False
        finally:
            self.discard()
        events.emit("checkpoint", learner=self.pointer.learner, seq=self.pointer.seq,
                    pointer_bytes=len(pointer),
                    moments_bytes=moments_bytes, parts=len(self.spool),
                    moments=self.pointer.moments.encoding if self.spool and self.pointer.moments else None,
                    duration_s=round(time.time() - t0, 3))
        if self.spool:
            self._delete_old(store)
        return True

    def discard(self) -> None:
        for _, path in self.spool:
            with contextlib.suppress(OSError):
                path.unlink()

    def _delete_old(self, store: Store) -> None:
        """Parts of generations before the previous one (this process's or a process's before it)."""
        current = {part.key for part in self.pointer.moments.parts} if self.pointer.moments else set()
        try:
            old = [k for k in store.list(self.folder) if PART_RE.match(k.rsplit("/", 1)[-1])
                   and k not in current and k not in self.keep]
            for key in old:
                store.delete(key)
        except StorageError as err:  # left for a later generation's deletion (or gc)
            log.warning("deleting old checkpoint parts under %s failed: %s", self.folder, err)


class Checkpointer:
    """A learner's checkpoint cadence and encoder: `due()` after each delta, `make(...)` the upload."""

    def __init__(self, keys: RunKeys, name: str, fingerprint: str, every: int | str, moments: str,
                 part_bytes: int = 64 << 20) -> None:
        self.keys, self.name, self.fingerprint = keys, name, fingerprint
        self.every_phases, self.every_s = checkpoint_cadence(every)
        self.encoding, self.part_bytes = moments, part_bytes
        self.phases = 0  # deltas (whole model) or cycles (fragments) since the last moments
        self.last_t = time.time()  # of the last moments (or the join)
        self.current: MomentsRef | None = None  # the newest moments written (what a pointer names)
        self.previous: set[str] = set()  # the generation before it: kept by the deletion
        self.spool_dir = scratch_dir()

    def joined(self, pointer: CheckpointPointer | None) -> None:
        """After a join: the cadence counts from now; the moments a resume read stay named."""
        self.phases, self.last_t = 0, time.time()
        self.current = pointer.moments if pointer is not None else None
        self.previous = set()

    def due(self) -> bool:
        """One more delta (a cycle): whether this one's checkpoint writes the moments."""
        self.phases += 1
        if self.every_phases is not None:
            return self.phases >= self.every_phases
        return time.time() - self.last_t >= self.every_s

    def make(self, seq: int, step: int, cursor: int, base: int, moments: bool,
             state: Callable[[], tuple[Iterator[tuple[str, torch.Tensor]], dict]]) -> CheckpointUpload:
        """The checkpoint after delta `seq`: the pointer, and with `moments` the optimizer's state encoded now
        (`state()`: its live tensors and meta; the caller does not step meanwhile) into spool files."""
        folder = self.keys.checkpoint(self.name, POINTER)[: -len(POINTER)]
        spool: list[tuple[str, Path]] = []
        if moments:
            tensors, meta = state()
            nonce = secrets.token_hex(4)
            parts = []
            encoded = self._encode_parts(tensors, {"seq": seq, "learner": self.name})
            for index, (data, names) in enumerate(encoded):
                key = self.keys.checkpoint(self.name, f"m{seq:012d}-{nonce}.p{index:04d}")
                path = self.spool_dir / f"ckpt-{os.getpid()}-{nonce}-{index}.bin"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                spool.append((key, path))
                parts.append(MomentsPart(key=key, bytes=len(data), checksum=object_checksum(data),
                                         names=names))
                del data
            self.previous = {p.key for p in self.current.parts} if self.current else set()
            self.current = MomentsRef(seq=seq, step=step, encoding=self.encoding, optimizer=meta, parts=parts,
                                      written_at=time.time())
            self.phases, self.last_t = 0, time.time()
        pointer = CheckpointPointer(learner=self.name, seq=seq, step=step, cursor=cursor, base_version=base,
                                    moments=self.current)
        return CheckpointUpload(pointer, spool, set(self.previous), folder)

    def _encode_parts(self, tensors: Iterator[tuple[str, torch.Tensor]],
                      meta: dict) -> Iterator[tuple[bytes, list[str]]]:
        """(object, its tensor names) of about part_bytes of fp32 input each (a state tensor is never split),
        encoded one tensor at a time from the live tensors."""
        encoder, held, names = None, 0, []
        for name, tensor in tensors:
            if encoder is None:
                encoder, names = self._encoder(meta), []
            names.append(name)
            array = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
            kind = name.partition("/")[0]
            if self.encoding == "int8" and kind in QUANTIZED:
                if kind in SQRT_KEYS:
                    array = np.sqrt(np.maximum(array, 0.0))  # a new array: sqrt-domain
                encoder.add(name, array, codec=QUANTIZED[kind])
            else:
                encoder.add(name, array, codec="fp32")
            held += array.nbytes
            del array
            if held >= self.part_bytes:
                yield encoder.finish(), names
                encoder, held = None, 0
        if encoder is not None:
            yield encoder.finish(), names

    def _encoder(self, meta: dict) -> Encoder:
        quantized = self.encoding == "int8"
        return Encoder(codec="int8" if quantized else "fp32", kind="state", fingerprint=self.fingerprint,
                       meta={**meta, "sqrt": list(SQRT_KEYS) if quantized else []}, shuffle=not quantized)


# ---- reading ------------------------------------------------------------------------------------------


@dataclass
class Restored:
    """What a checkpoint gives a resuming learner: step, data cursor, seq; the optimizer's state to import
    (tensors read lazily, one part at a time; None: start it fresh) and the pointer it came from."""

    step: int
    cursor: int
    seq: int | None
    tensors: Mapping[str, torch.Tensor] | None
    optimizer: dict
    pointer: CheckpointPointer | None
    moments_seq: int | None = None


def read_pointer(store: Store, keys: RunKeys, name: str) -> CheckpointPointer | None:
    """Learner `name`'s checkpoint pointer, or None (none, or unreadable: a new one replaces it)."""
    try:
        return read_record(store, keys.checkpoint(name, POINTER), CheckpointPointer)
    except (NotFound, RecordError, StorageError):
        return None


def read_checkpoint(store: Store, keys: RunKeys, name: str, fingerprint: str) -> Restored | None:
    """The newest checkpoint of learner `name` (None: there is none). CodecError / StorageError / RecordError
    when it cannot be read."""
    try:
        pointer = read_record(store, keys.checkpoint(name, POINTER), CheckpointPointer)
    except NotFound:
        return _legacy(store, keys, name, fingerprint)
    moments = pointer.moments
    if moments is None:
        return Restored(pointer.step, pointer.cursor, pointer.seq, None, {}, pointer)
    tensors = _Parts(store, moments, fingerprint)
    return Restored(pointer.step, pointer.cursor, pointer.seq, tensors, moments.optimizer, pointer,
                    moments.seq)


def _legacy(store: Store, keys: RunKeys, name: str, fingerprint: str) -> Restored | None:
    """The single object of a run made before pointers: the optimizer state in fp32 and the meta."""
    try:
        data = store.get(keys.checkpoint(name, LEGACY))
    except NotFound:
        return None
    header, tensors = decode_tensors(data, fingerprint=fingerprint)
    meta = header.meta
    return Restored(int(meta.get("step", 0)), int(meta.get("cursor", 0)), meta.get("seq"), tensors,
                    meta.get("optimizer") or {}, None)


class _Parts(Mapping[str, torch.Tensor]):
    """Every tensor of the moments' parts; each part read and checked when first touched, decoded one tensor
    at a time (the int8 ones dequantized, the sqrt-domain ones squared, rounded up)."""

    def __init__(self, store: Store, moments: MomentsRef, fingerprint: str) -> None:
        self.store, self.moments, self.fingerprint = store, moments, fingerprint
        self._where = {name: index for index, part in enumerate(moments.parts) for name in part.names}
        self._open: tuple[int, LazyObject] | None = None

    def _part(self, index: int) -> LazyObject:
        if self._open is None or self._open[0] != index:
            part = self.moments.parts[index]
            data = read_checked(self.store, part.key, part.checksum)
            self._open = (index, LazyObject(data, fingerprint=self.fingerprint))
        return self._open[1]

    def __getitem__(self, name: str) -> torch.Tensor:
        return moment(self._part(self._where[name]), name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def moment(obj: LazyObject, name: str) -> torch.Tensor:
    """State tensor `name` of a moments part, as the optimizer takes it (a sqrt-domain one squared, rounded
    up)."""
    array = obj.array(name)
    if name.partition("/")[0] in obj.header.meta.get("sqrt", []):
        array = _square_up(array, obj.header.block_size)
    return torch.from_numpy(array)


def round_trip(tensors: Mapping[str, torch.Tensor], encoding: str, fingerprint: str = "moments") -> dict:
    """What a resume reads back of these optimizer state tensors written with `encoding` (fp32 | int8), and
    the bytes written: ({name: tensor}, bytes). For measurements and tests."""
    writer = Checkpointer(RunKeys("x"), "x", fingerprint, 1, encoding)
    out, size = {}, 0
    for data, names in writer._encode_parts(iter(tensors.items()), {}):
        obj = LazyObject(data, fingerprint=fingerprint)
        size += len(data)
        out.update({name: moment(obj, name) for name in names})
    return {"tensors": out, "bytes": size}


def _square_up(root: np.ndarray, block_size: int) -> np.ndarray:
    """A sqrt-domain int8 tensor back to its square, each value rounded up by half its block's step first (the
    block's step is its largest value / 127), so the result is never below the exact value's square."""
    shape, flat = root.shape, root.reshape(-1)
    n = flat.size
    blocks = -(-n // block_size)
    padded = np.zeros(blocks * block_size, np.float32)
    padded[:n] = flat
    rows = padded.reshape(blocks, block_size)
    rows += (rows.max(axis=1, keepdims=True) / INT8_LEVELS) / 2
    np.square(rows, out=rows)
    return padded[:n].reshape(shape).copy()


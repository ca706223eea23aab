"""The checks a delta passes before a merge takes it: its size and its header's tensors against the chain's
layout before a payload byte is decoded (delta_size_bound, check_tensors), its header against its key, the
current version and the model (validate_delta), and the buffers it carries against the chain's
(split_buffers).

Contract: pure functions of their inputs; every failure is DeltaInvalid (DeltaStale: built on a version older
than `outer.max_staleness` allows) whose message is the reason recorded in the manifest; the judge
(trust/judge.py) calls them for the merger and `audit` alike.
"""

from __future__ import annotations

import math

from diloco.configs import Config
from diloco.storage.codec import CODECS, Header, codec_of
from diloco.storage.codec.header import FRAME_BYTES, PREFIX, block_size_of, stream_bytes
from diloco.training.buffers import check_values
from diloco.training.tensors import Tensors, all_finite, same_layout


class DeltaInvalid(ValueError):
    """A delta failed validation; the message is the reason recorded in the manifest."""


class DeltaStale(DeltaInvalid):
    """A delta built on a version older than `outer.max_staleness` allows (slow, not suspect)."""


NON_FINITE = "non-finite values (NaN or Inf)"  # the reason recorded for a delta with a NaN or an Inf
# a delta header's meta (learner, seq, counters, times): a few hundred bytes in practice
META_BYTES = 64 << 10


def _entry_bytes(name: str, shape: list[int], raw: int) -> int:
    """The most a tensor's header entry can take: its name, its shape, its frames' lengths, the keys."""
    # \uXXXX escapes at worst
    return len(name) * 6 + 21 * len(shape) + 21 * max(1, -(-raw // FRAME_BYTES)) + 96


def delta_size_bound(params: Tensors, buffers: list[dict]) -> int:
    """The largest object a delta of this chain can be, whatever the learner's codec: per tensor the largest
    stream of any codec (a quantized block is whole, so a one-element tensor costs a block), stored raw at
    worst (a frame the compression cannot shrink is stored raw), buffers exactly (fp32), plus its header. The
    merger's `max_delta_bytes` when the run sets none: the model's bytes, not a constant that caps the model's
    size."""
    total = PREFIX.size + META_BYTES + 16
    for name, value in params.items():
        n = value.numel()
        raw = max(stream_bytes(codec, n, block_size_of(codec)) for codec in CODECS)
        total += raw + _entry_bytes(name, list(value.shape), raw)
    for entry in buffers:
        raw = 4 * math.prod(entry["shape"])
        total += raw + _entry_bytes(entry["name"], list(entry["shape"]), raw)
    return total


def check_tensors(header: Header, params: Tensors, buffers: list[dict]) -> None:
    """The header's tensors are the chain's parameters (names and shapes, in order) and then, when it carries
    any, its buffers: checked on the header alone, so decoding a delta never allocates more than the model's
    own tensors. DeltaInvalid naming the first difference."""
    names = [(name, tuple(value.shape)) for name, value in params.items()]
    count = len(header.tensors)
    if count > len(names):  # what split_buffers checks again after decoding: the shapes must hold before it
        names += [(entry["name"], tuple(entry["shape"])) for entry in buffers]
    if count not in (len(names), len(names) + len(buffers)):
        raise DeltaInvalid(f"holds {count} tensors where the model has {len(names)} parameters"
                           + (f" and {len(buffers)} buffers" if buffers else ""))
    for i, (spec, (name, shape)) in enumerate(zip(header.tensors, names, strict=False)):
        if spec.name != name or tuple(spec.shape) != shape:
            raise DeltaInvalid(f"tensor {i} is {spec.name!r:.80} of shape {list(spec.shape)[:8]}, where the "
                               f"model has {name!r} of shape {list(shape)}")
    if count > len(names):
        raise DeltaInvalid(f"holds {count} tensors where the model has {len(names)}")


def split_buffers(header: Header, delta: Tensors, layout: list[dict]) -> Tensors:
    """Take a decoded delta's buffers off it (its last `meta.buffers` tensors) and check them against the
    buffers the chain merges (`layout`, run.json's): every one, in order, with its shape, stored exactly
    (fp32), finite, integral in an integer buffer. DeltaInvalid naming what is wrong; a chain without buffers
    takes deltas without any."""
    count = header.meta.get("buffers", 0)
    if type(count) is not int or not 0 <= count <= len(delta):
        raise DeltaInvalid(f"bad header field buffers: {count!r:.40}")
    if count != len(layout):
        names = ", ".join(e["name"] for e in layout[:6]) or "none"
        raise DeltaInvalid(f"carries {count} buffers where the run merges {len(layout)} ({names})")
    specs = header.tensors[len(header.tensors) - count:]
    for i, (spec, entry) in enumerate(zip(specs, layout, strict=True)):
        if spec.name != entry["name"] or list(spec.shape) != list(entry["shape"]):
            raise DeltaInvalid(f"buffer {i} is {spec.name!r:.80} of shape {list(spec.shape)}, where the run "
                               f"has {entry['name']!r} of shape {entry['shape']}")
        if codec_of(header, spec) != "fp32":
            raise DeltaInvalid(f"buffer {spec.name!r} is stored as {codec_of(header, spec)}, not exactly "
                               "(fp32)")
    buffers = {spec.name: delta.pop(spec.name) for spec in specs}
    why = check_values(buffers, layout)
    if why is not None:
        raise DeltaInvalid(why)
    return buffers


def validate_delta(header: Header, delta: Tensors, *, learner: str, seq: int, version: int,
                   params: Tensors, cfg: Config, check_finite: bool = True) -> int:
    """Check one decoded delta against its key, the current version and the model; returns staleness.
    The last check, every value finite, is the caller's when `check_finite` is False (the judge folds it
    into the delta's fp64 norm)."""
    meta = header.meta
    if header.kind != "delta":
        raise DeltaInvalid(f"not a delta (kind {header.kind!r})")
    if meta.get("learner") != learner or meta.get("seq") != seq:
        raise DeltaInvalid(f"header says {meta.get('learner')!r}/{meta.get('seq')!r}, key says "
                           f"{learner}/{seq}")
    for name in ("base_version", "tokens", "steps"):
        value = meta.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DeltaInvalid(f"bad header field {name}: {value!r}")
    if meta["steps"] == 0 or meta["tokens"] == 0:
        raise DeltaInvalid("empty delta (0 steps or 0 tokens)")
    base = meta["base_version"]
    if base > version:
        raise DeltaInvalid(f"base version {base} is newer than the current version {version}")
    staleness = version - base
    if staleness > cfg.outer.max_staleness:
        raise DeltaStale(f"stale: staleness {staleness} > max_staleness {cfg.outer.max_staleness}")
    if not same_layout(delta, params):
        raise DeltaInvalid("tensor names or shapes do not match the model")
    if check_finite and not all_finite(delta):
        raise DeltaInvalid(NON_FINITE)
    return staleness

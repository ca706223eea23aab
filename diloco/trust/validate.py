"""The checks a delta passes before a merge takes it: its header against its key, the current version and the
model (validate_delta), and the buffers it carries against the chain's (split_buffers).

Contract: pure functions of their inputs; every failure is DeltaInvalid (DeltaStale: built on a version older
than `outer.max_staleness` allows) whose message is the reason recorded in the manifest; the judge
(trust/judge.py) calls them for the merger and `audit` alike.
"""

from __future__ import annotations

from diloco.configs import Config
from diloco.storage.codec import Header, codec_of
from diloco.training.buffers import check_values
from diloco.training.tensors import Tensors, all_finite, same_layout


class DeltaInvalid(ValueError):
    """A delta failed validation; the message is the reason recorded in the manifest."""


class DeltaStale(DeltaInvalid):
    """A delta built on a version older than `outer.max_staleness` allows (slow, not suspect)."""


NON_FINITE = "non-finite values (NaN or Inf)"  # the reason recorded for a delta with a NaN or an Inf


def split_buffers(header: Header, delta: Tensors, layout: list[dict]) -> Tensors:
    """Take a decoded delta's buffers off it (its last `meta.buffers` tensors) and check them against the buffers the
    chain merges (`layout`, run.json's): every one, in order, with its shape, stored exactly (fp32), finite, integral
    in an integer buffer. DeltaInvalid naming what is wrong; a chain without buffers takes deltas without any."""
    count = header.meta.get("buffers", 0)
    if type(count) is not int or not 0 <= count <= len(delta):
        raise DeltaInvalid(f"bad header field buffers: {count!r:.40}")
    if count != len(layout):
        names = ", ".join(e["name"] for e in layout[:6]) or "none"
        raise DeltaInvalid(f"carries {count} buffers where the run merges {len(layout)} ({names})")
    specs = header.tensors[len(header.tensors) - count:]
    for i, (spec, entry) in enumerate(zip(specs, layout, strict=True)):
        if spec.name != entry["name"] or list(spec.shape) != list(entry["shape"]):
            raise DeltaInvalid(f"buffer {i} is {spec.name!r:.80} of shape {list(spec.shape)}, where the run has "
                               f"{entry['name']!r} of shape {entry['shape']}")
        if codec_of(header, spec) != "fp32":
            raise DeltaInvalid(f"buffer {spec.name!r} is stored as {codec_of(header, spec)}, not exactly (fp32)")
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
        raise DeltaInvalid(f"header says {meta.get('learner')!r}/{meta.get('seq')!r}, key says {learner}/{seq}")
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

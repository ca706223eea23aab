"""A run's buffers in the bucket: which ones a run merges (decided at creation), the version's buffers object
(`global/<version>-<nonce>.buffers`) that the merger writes, and loading a version's buffers into a model.

Contract: a run merges the buffers run.json lists (`buffers`; none for a model without any, a run with
`outer.buffers: keep`, or a run made before buffers were merged: then nothing here writes or reads anything).
The object holds them as fp32 in run.json's order, written raw like a version's params, and the manifest
references it with its checksum; in a fragmented run the buffers ride with fragment 0's chain. A merge that
took no learner's buffers (every delta rejected) copies its parent's object byte for byte. Never user code:
the merger and audit call this from run.json alone.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from diloco.run.context import RunContext
from diloco.run.objects import put_checksummed, read_checked, read_committed, write_state
from diloco.storage import Manifest, read_manifest
from diloco.storage.codec import CodecError
from diloco.training.buffers import buffer_layout, set_buffers
from diloco.training.tensors import Tensors

log = logging.getLogger("diloco.run")


def plan_buffers(model: nn.Module, mode: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(the buffers run.json records: what the run merges, the warnings to give once at the run's
    creation)."""
    ships, cannot = buffer_layout(model)
    if mode == "keep":
        kept = [e["name"] for e in ships] + cannot
        return [], [f"outer.buffers is keep: the model's buffers {_names(kept)} are not merged; each learner "
                    "keeps its own, and the evaluated, sampled and exported model keeps their initial "
                    "values"] if kept else []
    return ships, [f"the model's buffers {_names(cannot)} cannot be merged (fp32 cannot carry their dtype); "
                   "they keep their initial values in the evaluated and exported model"] if cannot else []


def _names(names: list[str]) -> str:
    return ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")


def warn_once(lines: list[str]) -> None:
    """The creation's warnings: once, through the log (on the terminal unless logging is configured
    otherwise)."""
    for line in lines:
        log.warning(line)


def write_buffers(ctx: RunContext, version: int, nonce: str, values: Tensors) -> dict[str, str]:
    """Write a version's buffers object; the manifest's fields that reference it."""
    key = ctx.keys.buffers(version, nonce)
    _, checksum = write_state(ctx.store, key, values, kind="buffers", fingerprint=ctx.fingerprint)
    return {"buffers_key": key, "buffers_checksum": checksum}


def version_buffers(ctx: RunContext, parent: Manifest, merged: Tensors | None, version: int,
                    nonce: str) -> dict[str, str]:
    """The buffers object of the merge on top of `parent`: the merged buffers, or (no learner's buffers were
    taken) the parent's object copied; the manifest's fields ({} when this chain holds no buffers)."""
    if not ctx.buffers:
        return {}
    if merged is not None:
        return write_buffers(ctx, version, nonce, merged)
    if not parent.buffers_key:
        return {}
    key = ctx.keys.buffers(version, nonce)
    data = read_checked(ctx.store, parent.buffers_key, parent.buffers_checksum)
    return {"buffers_key": key, "buffers_checksum": put_checksummed(ctx.store, key, data)}


def read_buffers(ctx: RunContext, manifest: Manifest) -> Tensors | None:
    """A version's buffers (fp32, run.json's order), or None when the run merges none or the version holds
    none. CorruptObject when the object fails its checks on every read; CodecError when it does not hold
    run.json's buffers."""
    if not ctx.buffers or not manifest.buffers_key:
        return None
    _, values = read_committed(ctx.store, manifest.buffers_key, fingerprint=ctx.fingerprint,
                               checksum=manifest.buffers_checksum,
                               what=f"version {manifest.version}'s buffers")
    expected = [(e["name"], list(e["shape"])) for e in ctx.buffers]
    if [(k, list(v.shape)) for k, v in values.items()] != expected:
        raise CodecError(f"{manifest.buffers_key}: holds {list(values)[:8]}, not run.json's buffers")
    return values


def run_buffers(ctx: RunContext, version: int) -> Tensors | None:
    """Run version `version`'s buffers: its manifest's, or in a fragmented run fragment 0's version
    `version`'s."""
    if not ctx.buffers:
        return None
    keys = ctx.keys.for_fragment(0) if ctx.fragments else ctx.keys
    return read_buffers(ctx, read_manifest(ctx.store, keys, version))


def install_buffers(ctx: RunContext, model: nn.Module, manifest: Manifest) -> bool:
    """Load the version's buffers into the model; whether there were any."""
    values = read_buffers(ctx, manifest)
    if values is not None:
        set_buffers(model, values, ctx.buffers)
    return values is not None


def install_run_buffers(ctx: RunContext, model: nn.Module, version: int) -> bool:
    """Load run version `version`'s buffers into the model (the evaluator, sample, export); whether there were
    any."""
    values = run_buffers(ctx, version)
    if values is not None:
        set_buffers(model, values, ctx.buffers)
    return values is not None

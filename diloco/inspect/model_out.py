"""A committed version's model, out: its parameters, the spec's model loaded with them, text sampled from it,
and exports (safetensors; the spec's own format, e.g. a Hugging Face save_pretrained folder).

Contract: `version_params` and `export_safetensors` need no user code (the bucket's tensors and the run's
layout); `load_model`, `sample` and `export_native` build the run's spec (user code) and check its layout.
Every one of them carries the version's merged buffers when the run merges buffers (run.json's `buffers`).
Every export is written to a temporary name and renamed, so a failed export leaves nothing half-written.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from diloco.run.buffers import install_run_buffers, run_buffers
from diloco.run.context import RunContext, RunError
from diloco.run.fragments import read_run_version, run_version
from diloco.storage import NotFound
from diloco.training.model import set_params
from diloco.training.spec import SpecError, TrainSpec
from diloco.training.tensors import Tensors


def version_params(ctx: RunContext, version: int | None = None) -> tuple[int, Tensors]:
    """(version, its parameters): the newest committed run version by default; RunError if it is not
    committed. The run's version over its chains (run/fragments.py): the root chain's, or for a fragmented run
    every fragment's version `version` put together."""
    newest = run_version(ctx)
    version = newest if version is None else version
    what = "run version" if ctx.fragments else "version"
    if version is None or version < 0 or (newest is not None and version > newest):
        why = "; a fragmented run's version is the oldest of its fragments' newest" if ctx.fragments else ""
        raise RunError(f"run {ctx.run_id!r} has no committed {what} {version} (newest: {newest}{why})")
    try:
        params, _, _ = read_run_version(ctx, version)
    except NotFound as err:
        if "retention" in str(err):
            raise RunError(f"run {ctx.run_id!r}: {what} {version} was removed by gc's retention; "
                           f"{err}") from None
        raise RunError(f"run {ctx.run_id!r} has no committed {what} {version}") from None
    return version, params


def num_params(ctx: RunContext) -> int:
    """Parameters of the run's model (from its layout; the newest version's tensors for an older run)."""
    if ctx.layout:
        return sum(math.prod(p["shape"]) for p in ctx.layout)
    return sum(t.numel() for t in version_params(ctx, 0)[1].values())


def load_model(ctx: RunContext, version: int | None = None) -> tuple[TrainSpec, nn.Module, int]:
    """(the run's spec, its model holding the version's parameters, the version), in eval mode."""
    from diloco.run.spec import build_model, check_layout, load_run_spec

    spec = load_run_spec(ctx)
    model = build_model(spec, ctx.cfg.data.seed)
    check_layout(ctx, model, "the export")
    version, params = version_params(ctx, version)
    set_params(model, params)
    install_run_buffers(ctx, model, version)
    model.eval()
    return spec, model, version


def sample(ctx: RunContext, version: int | None = None, prompt: str | None = None, *, seed: int | None = None,
           max_bytes: int | None = None) -> str | None:
    """Text the spec samples from the version's model (None when the spec has no sample); `prompt`, `seed` and
    `max_bytes`, when given, are passed by name, and SpecError names one the spec's sample does not take."""
    spec, model, _ = load_model(ctx, version)
    if spec.sample is None:
        return None
    given = {k: v for k, v in (("prompt", prompt), ("seed", seed), ("max_bytes", max_bytes)) if v is not None}
    takes = inspect.signature(spec.sample).parameters
    for name in given:
        if name not in takes:
            raise SpecError(f"the spec's sample(model) takes no {name}")
    return spec.sample(model, **given)


def _atomic_file(out: Path, write) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def export_safetensors(ctx: RunContext, out: Path, version: int | None = None) -> tuple[Path, int]:
    """The version's parameters (names as in the layout, tied weights once) as one safetensors file, and its
    merged buffers under their names in their own dtypes (metadata `buffers`: their names, JSON)."""
    from safetensors.torch import save_file

    version, params = version_params(ctx, version)
    metadata = {"run_id": ctx.run_id, "version": str(version), "fingerprint": ctx.fingerprint,
                "spec": ctx.cfg.spec, "format": "diloco.params"}
    tensors = {k: v.contiguous() for k, v in params.items()}
    buffers = run_buffers(ctx, version)
    if buffers is not None:
        dtypes = {e["name"]: getattr(torch, e["dtype"]) for e in ctx.buffers}
        tensors.update({k: v.to(dtypes[k]).contiguous() for k, v in buffers.items()})
        metadata["buffers"] = json.dumps(list(buffers))
    return _atomic_file(out, lambda tmp: save_file(tensors, tmp, metadata=metadata)), version


def export_native(ctx: RunContext, out: Path, version: int | None = None) -> tuple[Path, int]:
    """The spec's own export of the version's model into the folder `out` (e.g. save_pretrained)."""
    spec, model, version = load_model(ctx, version)
    if spec.export is None:
        raise SpecError(f"the spec {ctx.cfg.spec!r} has no export(model, folder): only safetensors is "
                        "available")
    if out.exists():
        raise RunError(f"--out {str(out)!r} exists: give a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        spec.export(model, tmp)
        shutil.move(str(tmp), out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, version

"""Create a run in the bucket: check its spec, then run.json (config, learners, model layout) and version 0.

Contract: everything is checked before anything is written — the spec is built, its model checked and its
functions run once (diloco.run.spec.probe) — so a bad input creates nothing; run.json is written once by
exclusive create; create_run is idempotent for the same config and refuses a different one.
"""

from __future__ import annotations

import contextlib
import socket
import time

from diloco import __version__
from diloco.configs import Config
from diloco.run.buffers import plan_buffers, warn_once, write_buffers
from diloco.run.checkpoint import write_checkpoint
from diloco.run.context import RunContext, RunError, open_run
from diloco.run.fragments import fragment_context, plan_for
from diloco.run.pin import PINNED, pin_of
from diloco.run.spec import SpecFiles, StagedFiles, build_model, probe, spec_of
from diloco.storage import Conflict, Manifest, RunKeys, commit, manifest_exists
from diloco.storage.keys import new_nonce, validate_new_learner_name
from diloco.storage.records import STORAGE_FORMAT, TRUST_RULES, RunRecord, write_record
from diloco.storage.store import Store
from diloco.training.buffers import get_buffers
from diloco.training.fragments import take
from diloco.training.model import get_flat_params
from diloco.training.spec import TrainSpec, layout_fingerprint, model_layout
from diloco.training.tensors import Tensors


def create_run(store: Store, run_id: str, cfg: Config, learners: list[str] | None = None, *,
               spec: TrainSpec | None = None) -> RunContext:
    """Create run.json and version 0, or join an existing run with the same config. `spec`: the config's
    spec already built (it is built here otherwise)."""
    keys = RunKeys(run_id)
    learners = [validate_new_learner_name(n) for n in learners or cfg.learner_names()]  # no role's name
    files = StagedFiles(store, keys)
    spec = spec or spec_of(cfg, files)
    model = build_model(spec, cfg.data.seed)  # version 0, and its layout
    buffers, warnings = plan_buffers(model, cfg.outer.buffers)
    initial = get_buffers(model, buffers)  # before the probe's forward pass moves running statistics
    tokens_per_step = probe(spec, model, {cfg.learner.ranks, *cfg.learner.ranks_per_learner.values()})
    layout = model_layout(model)
    # before anything is written: a bad count creates nothing
    fragments = plan_for(cfg.fragments.count, layout)
    record = RunRecord(run_id=run_id, created_at=time.time(), created_by=socket.gethostname(),
                       diloco_version=__version__, fingerprint=layout_fingerprint(layout), learners=learners,
                       config=cfg.model_dump(mode="json"), layout=layout, fragments=fragments,
                       buffers=buffers or None, tokens_per_step=tokens_per_step, trust_rules=TRUST_RULES,
                       storage_format=STORAGE_FORMAT)
    files.flush()  # before run.json: a process that sees the run finds its spec files
    try:
        write_record(store, keys.run_json(), record, exclusive=True)
    except Conflict:
        ctx = open_run(store, run_id)
        if ctx.cfg.model_dump() != cfg.model_dump():
            raise RunError(
                f"run {run_id!r} already exists in {store.url} with a different config; "
                "choose another --run-id or the same config"
            ) from None
        ctx.data_source = spec.data_source
        return ctx
    warn_once(warnings)  # the run is new: said once, not by every process that joins it
    ctx = RunContext(store, keys, cfg, record.fingerprint, learners, record.created_at, layout, fragments,
                     buffers,
                     spec.data_source, pin=PINNED, tokens_per_step=tokens_per_step, trust_rules=TRUST_RULES)
    params = get_flat_params(model)
    _commit_version_zero(ctx, params, initial, pin_of(record.to_bytes()))  # the bytes written: pinned
    for index, fragment in enumerate(fragments):  # every fragment's chain starts at its pieces of version 0
        _commit_version_zero(fragment_context(ctx, index), take(params, fragment), initial)
    return ctx


def fingerprint_of(cfg: Config, files: SpecFiles | None = None) -> str:
    """The fingerprint a run of this config would have (its spec's model layout); `files`: the spec files its
    factory may ask for (another run's, read only through StagedFiles)."""
    return layout_fingerprint(model_layout(build_model(spec_of(cfg, files), cfg.data.seed)))


def _commit_version_zero(ctx: RunContext, params: Tensors, buffers: Tensors, run_json: str = "") -> None:
    """Version 0 of the context's chain (the root's, or a fragment's): its checkpoint (the initial params; no
    outer state), then its manifest naming it; idempotent, the first commit wins. With the initial buffers
    when the chain holds the run's buffers; the root's pins run.json (`run_json`: its checksum)."""
    if manifest_exists(ctx.store, ctx.keys, 0):
        return
    ref = write_checkpoint(ctx, 0, params, None, ema={}, manifest_checksum="", created_by="init")
    manifest = Manifest(
        run_id=ctx.run_id, version=0, created_at=time.time(), merger_id="init", checkpoint=ref,
        run_json_checksum=run_json, **(write_buffers(ctx, 0, new_nonce(), buffers) if ctx.buffers else {}),
    )
    with contextlib.suppress(Conflict):  # another process committed version 0 first; ours is an orphan
        commit(ctx.store, ctx.keys, manifest)

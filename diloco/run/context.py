"""A run in the bucket: run.json (resolved config + fingerprint) and version 0, created once.

Contract: create_run is idempotent for the same config and refuses a different one; every
process of a run reads its config from run.json, so they cannot disagree.
"""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass

import torch

from diloco import __version__
from diloco.configs import Config, config_from_record
from diloco.run.controls import run_overrides
from diloco.run.objects import write_tensors
from diloco.storage import Conflict, Manifest, NotFound, RunKeys, commit, manifest_exists, open_store
from diloco.storage.keys import new_nonce
from diloco.storage.records import RecordError, RunRecord, read_record, write_record
from diloco.storage.store import Store
from diloco.training.model import build_model, get_flat_params, model_fingerprint


class RunError(ValueError):
    """The run does not exist, or exists with another configuration."""


@dataclass
class RunContext:
    store: Store
    keys: RunKeys
    cfg: Config
    fingerprint: str
    learners: list[str]
    created_at: float = 0.0  # run.json's: tells a new run from an old one of the same id

    @property
    def run_id(self) -> str:
        return self.keys.run_id


def model_identity(cfg: Config, model: torch.nn.Module | None = None) -> str:
    model = model if model is not None else build_model(cfg.model, seed=cfg.data.seed)
    return model_fingerprint(model, cfg.model)


def _run_record(cfg: Config, run_id: str, fingerprint: str, learners: list[str]) -> RunRecord:
    return RunRecord(run_id=run_id, created_at=time.time(), created_by=socket.gethostname(),
                     diloco_version=__version__, fingerprint=fingerprint, learners=learners,
                     config=cfg.model_dump(mode="json"))


def create_run(store: Store, run_id: str, cfg: Config, learners: list[str] | None = None) -> RunContext:
    """Create run.json and version 0, or join an existing run with the same config."""
    keys = RunKeys(run_id)
    learners = learners or cfg.learner_names()
    model = build_model(cfg.model, seed=cfg.data.seed)  # version 0, and the fingerprint of its layout
    fingerprint = model_identity(cfg, model)
    record = _run_record(cfg, run_id, fingerprint, learners)
    try:
        write_record(store, keys.run_json(), record, exclusive=True)
    except Conflict:
        ctx = open_run(store, run_id)
        if ctx.cfg.model_dump() != cfg.model_dump():
            raise RunError(
                f"run {run_id!r} already exists in {store.url} with a different config; "
                "choose another --run-id or the same config"
            ) from None
        return ctx
    ctx = RunContext(store, keys, cfg, fingerprint, learners, record.created_at)
    _commit_version_zero(ctx, model)
    return ctx


def _commit_version_zero(ctx: RunContext, model: torch.nn.Module) -> None:
    if manifest_exists(ctx.store, ctx.keys, 0):
        return
    nonce = new_nonce()
    key = ctx.keys.params(0, nonce)
    _, checksum = write_tensors(
        ctx.store, key, get_flat_params(model), kind="params", fingerprint=ctx.fingerprint
    )
    manifest = Manifest(
        run_id=ctx.run_id, version=0, created_at=time.time(), merger_id="init",
        params_key=key, params_checksum=checksum,
    )
    with contextlib.suppress(Conflict):  # another process committed version 0 first; ours is an orphan
        commit(ctx.store, ctx.keys, manifest)


def open_run(store: Store | str, run_id: str) -> RunContext:
    """The context of an existing run, its config read from run.json."""
    if isinstance(store, str):
        store = open_store(store)
    keys = RunKeys(run_id)
    try:
        record = read_record(store, keys.run_json(), RunRecord)
    except NotFound:
        raise RunError(f"no run {run_id!r} in {store.url} (missing {keys.run_json()})") from None
    except RecordError as err:
        raise RunError(f"run {run_id!r}: {err}") from None
    cfg = config_from_record(record.config)
    overrides = run_overrides(store, keys)  # `diloco resume` raised the target / set a new time limit
    if overrides:
        cfg = cfg.with_overrides(overrides)
    return RunContext(store, keys, cfg, record.fingerprint, list(record.learners), record.created_at)

"""`diloco fork`: a new run whose version 0 is another run's version V — its parameters, outer optimizer
state and merged buffers, byte for byte — with the provenance in the new run's run.json. Rollback is a fork at an earlier version.

Contract: the parent run is only read, never written; every input (the version, the new id, a config that
would change the model's layout) is checked before anything is written; the new run's objects are written
before its run.json and its version-0 manifest (exclusive creates), so a failure leaves orphans, never a
half-made run; the fork is a control op of the new run, recorded in its version-0 manifest.
"""

from __future__ import annotations

import socket
import time

from diloco import __version__
from diloco.configs import Config, config_from_record
from diloco.run.context import RunContext, RunError, open_run
from diloco.run.controls import operator_identity, read_op, write_op
from diloco.storage import Conflict, Manifest, NotFound, RunKeys, commit, latest_version, read_manifest
from diloco.storage.codec import object_checksum
from diloco.storage.keys import new_nonce, validate_run_id
from diloco.storage.manifest import ControlEntry, GuardState
from diloco.storage.records import RunRecord, read_record, write_record
from diloco.storage.store import Store


def _copy(store: Store, source: str, checksum: str, target: str) -> None:
    data = store.get(source)
    if object_checksum(data) != checksum:
        raise RunError(f"{source}: checksum does not match its manifest; not forking from a damaged version")
    store.put(target, data)


def _parent_version(parent: RunContext, version: int) -> Manifest:
    try:
        return read_manifest(parent.store, parent.keys, version)
    except NotFound:
        latest = latest_version(parent.store, parent.keys)
        raise RunError(f"run {parent.run_id!r} has no version {version} (its newest is {latest})") from None


def _copy_spec_files(store: Store, parent: RunContext, keys: RunKeys) -> None:
    """The parent's spec files (a trained tokenizer, ...) under the fork's <run>/spec/, before its run.json."""
    prefix = parent.keys.spec_file("x")[:-1]
    for key in store.list(prefix):
        store.put(keys.spec_file(key[len(prefix):]), store.get(key))


def fork_config(parent: RunContext, m: Manifest, cfg: Config | None) -> Config:
    """The fork's config: the parent's run.json config with the live settings in force at V, or `cfg` —
    which must keep the model (the same fingerprint)."""
    if cfg is None:
        record = read_record(parent.store, parent.keys.run_json(), RunRecord)
        cfg = config_from_record(record.config).with_overrides(m.guard.settings if m.guard else {})
    from diloco.run.create import fingerprint_of
    from diloco.run.spec import StagedFiles

    # the parent's spec files, staged and never flushed: the parent is only read
    fingerprint = fingerprint_of(cfg, StagedFiles(parent.store, parent.keys))
    if fingerprint != parent.fingerprint:
        raise RunError(f"a fork keeps the parent's model: this config's model fingerprint {fingerprint} is not "
                       f"run {parent.run_id!r}'s {parent.fingerprint} (change data, optimizer or run settings only)")
    return cfg


def fork_run(store: Store, run_id: str, at_version: int, new_run_id: str, cfg: Config | None = None,
             by: str | None = None) -> RunContext:
    """Create run `new_run_id` from run `run_id` at `at_version`; returns its context."""
    parent = open_run(store, run_id)
    validate_run_id(new_run_id)
    if new_run_id == run_id:
        raise RunError("--new-run-id must differ from --run-id (a fork is a new run)")
    keys = RunKeys(new_run_id)
    if store.exists(keys.run_json()):
        raise RunError(f"run {new_run_id!r} already exists in {store.url}; choose another --new-run-id")
    if parent.fragments or (cfg is not None and cfg.fragments.count > 1):
        raise RunError("fork of a fragmented run (fragments.count > 1) is not supported yet")
    m = _parent_version(parent, at_version)
    cfg = fork_config(parent, m, cfg)
    by = by or operator_identity()
    learners = list(m.guard.members) if m.guard and m.guard.members else list(parent.learners)
    nonce = new_nonce()
    params_key, outer_key = keys.params(0, nonce), (keys.outer(0, nonce) if m.outer_key else "")
    _copy(store, m.params_key, m.params_checksum, params_key)
    if m.outer_key:
        _copy(store, m.outer_key, m.outer_checksum, outer_key)
    # the parent's buffers at V, when it merges them and the fork does too (outer.buffers "mean")
    merges_buffers = bool(parent.buffers and m.buffers_key and cfg.outer.buffers == "mean")
    buffers = {"buffers_key": keys.buffers(0, nonce), "buffers_checksum": m.buffers_checksum} if merges_buffers else {}
    if merges_buffers:
        _copy(store, m.buffers_key, m.buffers_checksum, buffers["buffers_key"])
    _copy_spec_files(store, parent, keys)
    provenance = {"run_id": run_id, "storage": store.url, "version": at_version, "params_checksum": m.params_checksum,
                  "outer_checksum": m.outer_checksum, "tokens_total": m.tokens_total, "by": by, "t": time.time()}
    record = RunRecord(run_id=new_run_id, created_at=time.time(), created_by=socket.gethostname(),
                       diloco_version=__version__, fingerprint=parent.fingerprint, learners=learners,
                       config=cfg.model_dump(mode="json"), layout=list(parent.layout), forked_from=provenance,
                       buffers=list(parent.buffers) if merges_buffers else None)
    try:
        write_record(store, keys.run_json(), record, exclusive=True)
    except Conflict:
        raise RunError(f"run {new_run_id!r} was created meanwhile; choose another --new-run-id") from None
    ctx = open_run(store, new_run_id)
    op = write_op(store, keys, "fork", values={"from_run": run_id, "at_version": at_version}, by=by,
                  reason=f"fork of {run_id} at version {at_version}")
    entry = ControlEntry(name=op, **read_op(store, keys, op).model_dump())
    guard = GuardState(members=sorted(learners), norms=list(m.guard.norms) if m.guard else [], ops_cursor=op)
    commit(store, keys, Manifest(run_id=new_run_id, version=0, created_at=time.time(), merger_id="fork",
                                 params_key=params_key, params_checksum=m.params_checksum, outer_key=outer_key,
                                 outer_checksum=m.outer_checksum, tokens_total=m.tokens_total, guard=guard,
                                 controls=[entry], **buffers))
    return ctx

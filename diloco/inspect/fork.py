"""`diloco fork`: a new run whose version 0 is another run's version V — its parameters, outer optimizer state
and merged buffers, byte for byte, on every chain (a fragmented run's run version V: each fragment's version V
becomes that fragment's version 0) — with the provenance in the new run's run.json. Rollback is a fork at an
earlier version.

Contract: the parent run is only read, never written; every input (the version, the new id, a config that
would change the model's layout) is checked before anything is written; the new run's objects are written
before its run.json and its version-0 manifest (exclusive creates), so a failure leaves orphans, never a
half-made run; the fork is a control op of the new run, recorded in its version-0 manifest.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch

from diloco import __version__
from diloco.configs import Config, ConfigError, config_from_record, load_config
from diloco.merger.replay import recover
from diloco.run.checkpoint import manifest_checksum, write_checkpoint
from diloco.run.context import RunContext, RunError, open_run
from diloco.run.controls import operator_identity, read_op, write_op
from diloco.run.fragments import chain_contexts, num_fragments, run_version
from diloco.run.pin import pin_of
from diloco.storage import Conflict, Manifest, NotFound, RunKeys, commit, open_store
from diloco.storage.codec import object_checksum
from diloco.storage.keys import new_nonce, validate_run_id
from diloco.storage.manifest import ControlEntry, GuardState
from diloco.storage.records import STORAGE_FORMAT, RunRecord, read_record, write_record
from diloco.storage.store import Store
from diloco.storage.window import read_full_manifest, write_window
from diloco.training.fragments import put_
from diloco.training.tensors import Tensors


def _copy(store: Store, source: str, checksum: str, target: str) -> bytes:
    data = store.get(source)
    if object_checksum(data) != checksum:
        raise RunError(f"{source}: checksum does not match its manifest; not forking from a damaged version")
    store.put(target, data)
    return data


def _parent_version(parent: RunContext, version: int) -> list[Manifest]:
    """Version `version` of every chain of the parent (a fragmented run's: its run version, on every
    fragment)."""
    try:
        return [read_full_manifest(parent.store, chain.keys, version) for chain in chain_contexts(parent)]
    except NotFound:
        newest = run_version(parent)
        what = "run version" if parent.fragments else "version"
        raise RunError(f"run {parent.run_id!r} has no {what} {version} (its newest is {newest})") from None


def _copy_spec_files(store: Store, parent: RunContext, keys: RunKeys) -> None:
    """The parent's spec files (a trained tokenizer, ...) under the fork's <run>/spec/, before its
    run.json."""
    prefix = parent.keys.spec_file("x")[:-1]
    for key in store.list(prefix):
        store.put(keys.spec_file(key[len(prefix):]), store.get(key))


def fork_config(parent: RunContext, m: Manifest, cfg: Config | None) -> Config:
    """The fork's config: the parent's run.json config with the live settings in force at V, or `cfg` —
    which must keep the model (the same fingerprint) and its fragments (each chain forks into its own)."""
    if cfg is None:
        record = read_record(parent.store, parent.keys.run_json(), RunRecord)
        cfg = config_from_record(record.config).with_overrides(m.guard.settings if m.guard else {})
    from diloco.run.create import fingerprint_of
    from diloco.run.spec import StagedFiles

    count = num_fragments(parent)
    if cfg.fragments.count != count:
        raise RunError(f"a fork keeps the parent's fragments: run {parent.run_id!r} has fragments.count "
                       f"{count}, this config {cfg.fragments.count} (each chain's version becomes the fork's "
                       f"version 0)")
    # the parent's spec files, staged and never flushed: the parent is only read
    fingerprint = fingerprint_of(cfg, StagedFiles(parent.store, parent.keys))
    if fingerprint != parent.fingerprint:
        raise RunError(f"a fork keeps the parent's model: this config's model fingerprint {fingerprint} is "
                       f"not run {parent.run_id!r}'s {parent.fingerprint} (change data, optimizer or run "
                       f"settings only)")
    return cfg


def _chain_version_zero(theirs: RunContext, m: Manifest, chain: RunContext,
                        buffers: bool) -> tuple[dict, Tensors]:
    """One chain's state at V (recovered from the parent's log: its checkpoint and the merges after it,
    replayed and checked) as version 0's checkpoint of the same chain of the fork, and its buffers object
    copied when the fork merges them; (the version-0 manifest's fields, the params)."""
    state = recover(theirs, m, newest=False)
    ref = write_checkpoint(chain, 0, state.params, state.outer, ema={}, manifest_checksum="",
                           created_by="fork")
    fields: dict = {"checkpoint": ref}
    if buffers:
        nonce = new_nonce()
        fields.update(buffers_key=chain.keys.buffers(0, nonce), buffers_checksum=m.buffers_checksum)
        _copy(chain.store, m.buffers_key, m.buffers_checksum, fields["buffers_key"])
    return fields, state.params


def _write_whole_model(root: RunContext, whole: Tensors, buffers_of: Manifest | None) -> dict:
    """A fragmented fork's root chain, version 0: the whole model at V (every fragment's params put together,
    and fragment 0's buffers), as a created run's root holds its initial model; the manifest's fields for
    it."""
    fields: dict = {"checkpoint": write_checkpoint(root, 0, whole, None, ema={}, manifest_checksum="",
                                                   created_by="fork")}
    if buffers_of is not None:
        nonce = new_nonce()
        fields.update(buffers_key=root.keys.buffers(0, nonce), buffers_checksum=buffers_of.buffers_checksum)
        _copy(root.store, buffers_of.buffers_key, buffers_of.buffers_checksum, fields["buffers_key"])
    return fields


def fork_run(store: Store, run_id: str, at_version: int, new_run_id: str, cfg: Config | None = None,
             by: str | None = None) -> RunContext:
    """Create run `new_run_id` from run `run_id` at `at_version`, its run version: every chain's version
    `at_version` becomes version 0 of the same chain of the new run (the root's, or each fragment's, buffers
    included); returns its context."""
    parent = open_run(store, run_id)
    validate_run_id(new_run_id)
    if new_run_id == run_id:
        raise RunError("--new-run-id must differ from --run-id (a fork is a new run)")
    keys = RunKeys(new_run_id)
    if store.exists(keys.run_json()):
        raise RunError(f"run {new_run_id!r} already exists in {store.url}; choose another --new-run-id")
    heads = _parent_version(parent, at_version)
    m = heads[0]  # the root chain's, or fragment 0's: the live settings, members and buffers ride with it
    cfg = fork_config(parent, m, cfg)
    by = by or operator_identity()
    learners = list(m.guard.members) if m.guard and m.guard.members else list(parent.learners)
    # the parent's buffers at V, when it merges them and the fork does too (outer.buffers "mean")
    merges_buffers = bool(parent.buffers and m.buffers_key and cfg.outer.buffers == "mean")
    fork_ctx = RunContext(store, keys, cfg, parent.fingerprint, learners, layout=list(parent.layout),
                          fragments=list(parent.fragments),
                          buffers=list(parent.buffers) if merges_buffers else [])
    theirs, chains = chain_contexts(parent), chain_contexts(fork_ctx)
    whole = ({e["name"]: torch.zeros(e["shape"], dtype=torch.float32) for e in parent.layout}
             if parent.fragments else None)
    objects = []
    for index, (their, chain, head) in enumerate(zip(theirs, chains, heads, strict=True)):
        fields, params = _chain_version_zero(their, head, chain, buffers=merges_buffers and index == 0)
        objects.append(fields)
        if whole is not None:
            put_(whole, parent.fragments[index], params)
        del params
    root = None if whole is None else _write_whole_model(fork_ctx, whole, m if merges_buffers else None)
    del whole
    _copy_spec_files(store, parent, keys)
    sums = [manifest_checksum(their, head.version) for their, head in zip(theirs, heads, strict=True)]
    provenance = {"run_id": run_id, "storage": store.url, "version": at_version, "manifest_checksum": sums[0],
                  "tokens_total": min(h.tokens_total for h in heads), "by": by, "t": time.time(),
                  **({"fragments": [{"manifest_checksum": c} for c in sums]} if parent.fragments else {})}
    record = RunRecord(run_id=new_run_id, created_at=time.time(), created_by=socket.gethostname(),
                       diloco_version=__version__, fingerprint=parent.fingerprint, learners=learners,
                       config=cfg.model_dump(mode="json"), layout=list(parent.layout), forked_from=provenance,
                       buffers=list(parent.buffers) if merges_buffers else None,
                       fragments=list(parent.fragments), tokens_per_step=parent.tokens_per_step,
                       trust_rules=parent.trust_rules if parent.trust_rules > 1 else None,
                       storage_format=STORAGE_FORMAT)
    try:
        write_record(store, keys.run_json(), record, exclusive=True)
    except Conflict:
        raise RunError(f"run {new_run_id!r} was created meanwhile; choose another --new-run-id") from None
    op = write_op(store, keys, "fork", values={"from_run": run_id, "at_version": at_version}, by=by,
                  reason=f"fork of {run_id} at version {at_version}")
    entry = ControlEntry(name=op, **read_op(store, keys, op).model_dump())
    if root is not None:  # the whole model first, as create_run commits it
        guard = GuardState(members=sorted(learners), ops_cursor=op)
        commit(store, keys, Manifest(run_id=new_run_id, version=0, created_at=time.time(), merger_id="fork",
                                     tokens_total=provenance["tokens_total"], guard=guard, controls=[entry],
                                     run_json_checksum=pin_of(record.to_bytes()),  # pinned as written
                                     **root))
    for chain, head, fields in zip(chains, heads, objects, strict=True):
        guard = GuardState(members=sorted(learners), norms=list(head.guard.norms) if head.guard else [],
                           norm_learners=list(head.guard.norm_learners) if head.guard else [], ops_cursor=op)
        if parent.window_apart:  # the parent's window, kept as the fork's own (unpublished)
            guard.window = write_window(store, chain.keys, 0, guard, {})
        pinned = {"run_json_checksum": pin_of(record.to_bytes())} if chain.keys is keys else {}  # the root's
        commit(store, chain.keys, Manifest(run_id=new_run_id, version=0, created_at=time.time(),
                                           merger_id="fork", tokens_total=head.tokens_total, guard=guard,
                                           controls=[entry], **fields, **pinned))
    return open_run(store, new_run_id)  # opened again: its version 0 (and run.json's pin) committed now


def fork(storage: str | Store, run_id: str, at_version: int, new_run_id: str, *, config: str | None = None,
         overrides: dict[str, Any] | None = None, by: str | None = None) -> RunContext:
    """A new run whose version 0 is `run_id`'s version `at_version`; the parent is untouched. `config` (a
    recipe name or a YAML path) and `overrides`: the fork's config instead of the parent's (the same model
    and fragments)."""
    cfg = None
    if config is not None or overrides:
        if config is None:
            raise ConfigError("overrides of a fork need --config (the recipe they apply to)")
        cfg = load_config(config).with_overrides(overrides or {})
    store = open_store(storage) if isinstance(storage, str) else storage
    return fork_run(store, run_id, at_version, new_run_id, cfg, by=by)

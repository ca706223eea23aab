"""A chain's global parameters at any version, from the log (docs/STORAGE.md): the checkpoint at or before it
and the compact updates after it. The one reader of every role that needs a version's parameters — a
learner rejoining or far behind, the evaluator (which follows the updates), `export`, `sample`, `fork` —
and of `read_run_version`.

Contract: G_v = G_c + decode(update_{c+1}) + ... + decode(update_v) in fp32, in order: the exact bits the
merger holds and every learner installs. A manifest that names its params itself (schema 1: runs made
before the log) is read directly. Every object is checked against its recorded checksum (CorruptObject
names one that fails every read); StorageError passes through for the caller to retry; inputs are never
modified.
"""

from __future__ import annotations

import dataclasses

from diloco.run.checkpoint import read_start
from diloco.run.context import RunContext
from diloco.run.objects import read_ahead, read_committed
from diloco.storage import Manifest, NotFound, read_manifest
from diloco.storage.store import Store
from diloco.training.tensors import Tensors, add_, clone


def version_name(ctx: RunContext, version: int) -> str:
    """How an error names a chain's version: \"version v\", or \"fragment p's version v\"."""
    fragment = ctx.keys.fragment
    return f"version {version}" if fragment is None else f"fragment {fragment}'s version {version}"


def apply_updates(ctx: RunContext, glob: Tensors, first: int, last: int, store: Store | None = None,
                  last_manifest: Manifest | None = None) -> Manifest | None:
    """G += decode(update_j) for j = first..last, in place and in order; returns version last's manifest (None
    when first > last). The next update is read, checked and decoded on a second thread while this one is
    added (the adds stay in order: the same bits). NotFound when an update is gone (retention: start from a
    checkpoint)."""
    store = store or ctx.store

    def fetch(v: int) -> tuple[Manifest, Tensors]:
        m = last_manifest if last_manifest is not None and v == last_manifest.version else \
            read_manifest(store, ctx.keys, v)
        return m, read_committed(store, m.update_key, fingerprint=ctx.fingerprint, checksum=m.update_checksum,
                                 what=f"{version_name(ctx, v)}'s update")[1]

    manifest = None
    for _, (read, update) in read_ahead(range(first, last + 1), fetch, "updates"):
        add_(glob, update)
        manifest = read
        del update
    return manifest


def chain_params(ctx: RunContext, manifest: Manifest, *, newest: bool = False,
                 store: Store | None = None) -> Tensors:
    """The chain's parameters at `manifest`'s version: its own params object (schema 1), or the checkpoint it
    names (`newest`: or a newer one that landed since, found by one listing) plus the updates after it."""
    store = store or ctx.store
    if manifest.params_key:
        return read_committed(store, manifest.params_key, fingerprint=ctx.fingerprint,
                              checksum=manifest.params_checksum,
                              what=f"{version_name(ctx, manifest.version)}'s params")[1]
    reader = ctx if store is ctx.store else _with_store(ctx, store)
    start = read_start(reader, manifest, outer=False, newest=newest)
    glob = start.params
    apply_updates(ctx, glob, start.version + 1, manifest.version, store, last_manifest=manifest)
    return glob


def params_at(ctx: RunContext, version: int, store: Store | None = None) -> tuple[Tensors, Manifest]:
    """(G_version, its manifest) of the chain. NotFound when the version is not committed."""
    manifest = read_manifest(store or ctx.store, ctx.keys, version)
    return chain_params(ctx, manifest, store=store), manifest


def _with_store(ctx: RunContext, store: Store) -> RunContext:
    return dataclasses.replace(ctx, store=store)


class ChainFollower:
    """One chain's parameters, followed along its versions (the evaluator): a newer version within `reach`
    versions of the one held is the held one plus its updates (u bytes a version instead of a params read),
    a farther one (or an older one, or one whose updates are gone) is read from its checkpoint. Holds one
    copy of the chain."""

    def __init__(self, ctx: RunContext, reach: int) -> None:
        self.ctx, self.reach = ctx, reach
        self.version: int | None = None
        self.params: Tensors | None = None
        self.updates_read = 0  # for a report: versions followed by their update
        self.checkpoints_read = 0  # ... and read from a checkpoint

    def at(self, manifest: Manifest) -> Tensors:
        """G at `manifest`'s version (a copy the caller owns)."""
        held, target = self.version, manifest.version
        if held is not None and held <= target <= held + self.reach and not manifest.params_key:
            try:
                apply_updates(self.ctx, self.params, held + 1, target, last_manifest=manifest)
            except NotFound:  # retention removed an update: from the checkpoint instead
                pass
            except BaseException:
                self.params, self.version = None, None  # partly moved: not a version any more
                raise
            else:
                self.updates_read += target - held
                self.version = target
                return clone(self.params)
        self.params, self.version = None, None
        self.params = chain_params(self.ctx, manifest)
        self.version = target
        self.checkpoints_read += 1
        return clone(self.params)

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

import torch

from diloco.run.checkpoint import checkpoint_of, read_start
from diloco.run.context import RunContext
from diloco.run.objects import CorruptObject, Prefetch, corrupt_message, read_committed, read_committed_lazy
from diloco.storage import Manifest, NotFound, read_manifest
from diloco.storage.codec import CodecError, LazyObject
from diloco.storage.store import Store
from diloco.training.tensors import Tensors, clone

# threads that add one update's large tensors (row ranges: the same bits); a rejoin's reads and adds come
# before the learner's first step, and a learner's read-ahead thread already decodes beside it. A reader
# of several chains at once adds on one thread each (their chains already share the cores)
ADD_WORKERS = 2


def version_name(ctx: RunContext, version: int) -> str:
    """How an error names a chain's version: \"version v\", or \"fragment p's version v\"."""
    fragment = ctx.keys.fragment
    return f"version {version}" if fragment is None else f"fragment {fragment}'s version {version}"


def apply_updates(ctx: RunContext, glob: Tensors, first: int, last: int, store: Store | None = None,
                  last_manifest: Manifest | None = None, ahead: Prefetch | None = None,
                  add_workers: int = ADD_WORKERS) -> Manifest | None:
    """G += decode(update_j) for j = first..last, in place and in order; returns version last's manifest (None
    when first > last). The next update is read, checked and decompressed on a second thread while this one
    is added (`ahead`: a Prefetch of update_fetcher's already started, e.g. during the checkpoint read; it
    holds versions first..last); the adds stay in order: the same bits. `add_workers`: threads per add.
    NotFound when an update is gone (retention: start from a checkpoint)."""
    if first > last:
        return None
    own = ahead is None
    if ahead is None:
        ahead = Prefetch(range(first, last + 1), update_fetcher(ctx, store or ctx.store, last_manifest),
                         "updates", depth=1)
    try:
        ahead.skip_until(lambda version: version >= first)
        manifest = None
        for version, (read, update) in ahead:  # versions first..last
            add_update(glob, update, f"{version_name(ctx, version)}'s update", read.update_key, add_workers)
            manifest = read
            del update
        return manifest
    finally:
        if own:
            ahead.close()


def update_fetcher(ctx: RunContext, store: Store, last_manifest: Manifest | None = None):
    """version -> (its manifest, its update read, checked and decompressed: LazyObject.unframe_all)."""
    def fetch(v: int) -> tuple[Manifest, LazyObject]:
        m = last_manifest if last_manifest is not None and v == last_manifest.version else \
            read_manifest(store, ctx.keys, v)
        return m, read_committed_lazy(store, m.update_key, fingerprint=ctx.fingerprint,
                                      checksum=m.update_checksum,
                                      what=f"{version_name(ctx, v)}'s update").unframe_all()
    return fetch


def add_update(glob: Tensors, update: LazyObject, what: str, key: str, workers: int = ADD_WORKERS) -> None:
    """glob += the update, tensor by tensor, each decoded a chunk at a time into the tensor
    (LazyObject.add_to: the bits of adding the decoded update, without it); CorruptObject naming the update
    when it does not decode (its checksum matched the committed one: the writer's fault, no retry mends
    it)."""
    for name, value in glob.items():
        try:
            if value.is_contiguous() and value.dtype == torch.float32:
                update.add_to(name, value.numpy(), workers=workers)
            else:
                value.add_(torch.from_numpy(update.array(name)))
        except (CodecError, KeyError, ValueError) as err:
            raise CorruptObject(corrupt_message(what, key, f"{type(err).__name__}: {err}")) from None


# updates a reader of a checkpoint fetches while it reads the checkpoint (each held decompressed until added:
# ~0.56 B/param at int4), so their reads, checks and decompression are off the path of the adds
UPDATES_AHEAD = 4


def chain_params(ctx: RunContext, manifest: Manifest, *, newest: bool = False,
                 store: Store | None = None, add_workers: int = ADD_WORKERS) -> Tensors:
    """The chain's parameters at `manifest`'s version: its own params object (schema 1), or the checkpoint it
    names (`newest`: or a newer one that landed since, found by one listing) plus the updates after it
    (`add_workers`: apply_updates')."""
    store = store or ctx.store
    if manifest.params_key:
        return read_committed(store, manifest.params_key, fingerprint=ctx.fingerprint,
                              checksum=manifest.params_checksum,
                              what=f"{version_name(ctx, manifest.version)}'s params")[1]
    reader = ctx if store is ctx.store else _with_store(ctx, store)
    ref = checkpoint_of(reader, manifest, newest=newest)
    # the updates after the checkpoint start arriving while it is read (UPDATES_AHEAD of them at most)
    fetch = update_fetcher(ctx, store, manifest)
    versions = range(ref.version + 1, manifest.version + 1)
    with Prefetch(versions, fetch, "updates", depth=UPDATES_AHEAD) as ahead:
        start = read_start(reader, manifest, outer=False, newest=newest, ref=ref)
        glob = start.params
        apply_updates(ctx, glob, start.version + 1, manifest.version, store, last_manifest=manifest,
                      ahead=ahead, add_workers=add_workers)
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

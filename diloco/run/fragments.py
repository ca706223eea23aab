"""A fragmented run's chains: one RunContext per fragment (its own namespace and layout), version 0 of each,
and the run's newest state across them (docs/STORAGE.md, "Fragments").

Contract: a run without fragments (fragments.count = 1, run.json's `fragments` empty) has one chain, the root,
and every function here is then exactly the root-chain call it replaces. A fragmented run's version is the
minimum over its fragments' versions: every fragment has merged at least that many times.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from diloco.configs import ConfigError
from diloco.run.chain_state import ChainFollower, chain_params
from diloco.run.context import RunContext
from diloco.storage import Manifest, ManifestError, chain_problems, latest_version, read_latest, read_manifest
from diloco.storage.store import Store
from diloco.training.fragments import FragmentError, fragment_layout, plan_fragments, put_
from diloco.training.tensors import Tensors


def plan_for(cfg_count: int, layout: list[dict]) -> list[dict]:
    """The fragment layout run.json records: [] for one fragment (the root chain), else plan_fragments."""
    if cfg_count == 1:
        return []
    try:
        return plan_fragments(layout, cfg_count)
    except FragmentError as err:
        raise ConfigError(f"invalid config: {err}") from None


def shard_merger_id(shard: int) -> str:
    """`merger` for shard 0 (the id of an unsharded run's merger), `merger-s<shard>` for the others."""
    return "merger" if shard == 0 else f"merger-s{shard}"


_SHARD_ID_RE = re.compile(r"merger(?:-[0-9]+)?|merger-s([1-9][0-9]*|0)(?:-[a-z0-9]+)?")


def shard_of_id(merger_id: str) -> int:
    """The shard a merger id names: `merger` (or `merger-<n>`, a second process of it, as a chaos plan's
    second_merger) -> 0; `merger-s<k>` (or `merger-s<k>-<tag>`) -> k; ValueError naming the id otherwise."""
    match = _SHARD_ID_RE.fullmatch(merger_id)
    if match is None:
        raise ValueError(f"merger id {merger_id!r} names no shard: it must be merger[-<n>] or "
                         "merger-s<k>[-<tag>]")
    return int(match.group(1) or 0)


def merger_ids(ctx: RunContext) -> list[str]:
    """The run's mergers, one per shard: `merger` alone, or merger, merger-s1, ... for a fragmented run."""
    return [shard_merger_id(s) for s in range(ctx.cfg.merger.shards if ctx.fragments else 1)]


def num_fragments(ctx: RunContext) -> int:
    return len(ctx.fragments) or 1


def fragment_context(ctx: RunContext, index: int) -> RunContext:
    """The chain of fragment `index`: its keys under fragments/<p:04d>/, its pieces as the layout; the run's
    buffers ride with fragment 0's chain (its deltas carry them, its versions hold them), no other's."""
    if not ctx.fragments:
        if index != 0:
            raise ValueError(f"run {ctx.run_id} has one fragment; there is no fragment {index}")
        return ctx
    if not 0 <= index < len(ctx.fragments):
        raise ValueError(f"run {ctx.run_id} has {len(ctx.fragments)} fragments; there is no fragment {index}")
    return dataclasses.replace(ctx, keys=ctx.keys.for_fragment(index),
                               layout=fragment_layout(ctx.fragments[index]),
                               fragments=[], buffers=ctx.buffers if index == 0 else [])


def chain_contexts(ctx: RunContext) -> list[RunContext]:
    """Every version chain of the run, in fragment order: the root chain alone (P = 1), or each fragment's
    (the root chain of a fragmented run holds version 0 only: the whole initial model)."""
    return [fragment_context(ctx, index) for index in range(num_fragments(ctx))]


def manifests(ctx: RunContext) -> list[Manifest]:
    """Every manifest of the run's chain (the root's, or a fragment context's), by version: 0 up to the newest
    that read_latest takes; a stray key above a gap, or an unreadable one at the top, is not part of it
    (chain_report)."""
    newest = read_latest(ctx.store, ctx.keys)
    return [] if newest is None else [*(read_manifest(ctx.store, ctx.keys, v) for v in range(newest.version)),
                                      newest]


def fragment_versions(ctx: RunContext, store: Store | None = None) -> list[int | None]:
    """The newest committed version of every fragment's chain (fresh listings), in fragment order."""
    store = store or ctx.store
    if not ctx.fragments:
        return [latest_version(store, ctx.keys)]
    return [latest_version(store, ctx.keys.for_fragment(p)) for p in range(len(ctx.fragments))]


class ChainWatch:
    """The newest version (and manifest) of every chain, kept between polls: each poll lists only what is
    above the version it knows (storage.latest_version's `after`: S3's StartAfter), so a poller's cost follows
    what is new, not the run's age, and a manifest reads only when its chain moved. For the roles' stop
    checks, the evaluator's and the supervisor's polls."""

    def __init__(self, ctx: RunContext, store: Store | None = None) -> None:
        self.ctx, self.store = ctx, store or ctx.store
        count = len(ctx.fragments) or 1
        self.keys = [ctx.keys.for_fragment(p) for p in range(count)] if ctx.fragments else [ctx.keys]
        self.known: list[int | None] = [None] * count
        self._heads: list[Manifest | None] = [None] * count

    def versions(self) -> list[int | None]:
        """Every chain's newest version (None before version 0), in fragment order: a version the listing
        shows is taken once its manifest reads and chains (read_latest), so a poller never acts on a stray or
        unreadable one. StorageError from the bucket."""
        for index, keys in enumerate(self.keys):
            known = self.known[index]
            if latest_version(self.store, keys, after=known) == known:
                continue  # nothing new: one listing, no read
            try:
                head = read_latest(self.store, keys, after=known)
            except ManifestError:  # nothing readable near the top: keep what is known (chain_report names it)
                continue
            if head is not None and (known is None or head.version > known):
                self.known[index], self._heads[index] = head.version, head
        return list(self.known)

    def run_version(self) -> int | None:
        """The run's version: the minimum over the chains' newest (None before every chain has version 0)."""
        versions = self.versions()
        return None if any(v is None for v in versions) else min(versions)

    def heads(self) -> list[Manifest | None]:
        """Every chain's newest manifest (read when its chain moved)."""
        self.versions()
        return list(self._heads)


def chain_report(ctx: RunContext) -> list[str]:
    """One line per manifest key of the run's chains that is no version (above a gap, unreadable or not
    chained): what `diloco status` reports and every reader of the newest version steps over
    (storage.chain_problems)."""
    count = len(ctx.fragments) or 1
    chains = [ctx.keys.for_fragment(p) for p in range(count)] if ctx.fragments else [ctx.keys]
    return [line for keys in chains for line in chain_problems(ctx.store, keys)]


def run_version(ctx: RunContext, store: Store | None = None) -> int | None:
    """The run's version: the root chain's newest, or for fragments the minimum over the fragments' newest
    (`store`: another view of the run's store, e.g. one with its own retries)."""
    versions = fragment_versions(ctx, store)
    return None if any(v is None for v in versions) else min(versions)


def read_run_version(ctx: RunContext, version: int,
                     followers: list[ChainFollower] | None = None) -> tuple[Tensors, int, float]:
    """(whole-model params, tokens merged, committed at) of run version `version`: the root manifest's, or for
    fragments every fragment's version `version` put together (the tokens every fragment merged: the
    minimum). Each chain's params from its checkpoint and updates (diloco.run.chain_state), or through
    `followers` (one per chain, the evaluator's: the updates since the version they hold)."""
    manifests, parts = [], []
    for index, chain in enumerate(chain_contexts(ctx)):
        manifest = read_manifest(ctx.store, chain.keys, version)
        part = followers[index].at(manifest) if followers is not None else chain_params(chain, manifest)
        manifests.append(manifest)
        parts.append(part)
    if not ctx.fragments:
        return parts[0], manifests[0].tokens_total, manifests[0].created_at
    params = {e["name"]: torch.zeros(e["shape"], dtype=torch.float32) for e in ctx.layout}
    for fragment, part in zip(ctx.fragments, parts, strict=True):
        put_(params, fragment, part)
    return params, min(m.tokens_total for m in manifests), max(m.created_at for m in manifests)


def chain_followers(ctx: RunContext, reach: int) -> list[ChainFollower]:
    """One ChainFollower per chain of the run (read_run_version's `followers`)."""
    return [ChainFollower(chain, reach) for chain in chain_contexts(ctx)]

"""A run's end: `run.num_versions` committed, or `run.num_tokens` merged (a token budget; 0: none) — on every
chain.

Contract: a chain (the root, or one fragment's) has reached the target once its newest manifest's version is
>= num_versions or its tokens_total >= num_tokens > 0; the run has once every chain has (so each merger stops
its own chains, and the run ends exactly when the last one does). Without a token budget this reads only the
versions (one listing per chain), as before; with one, the newest manifest of each chain too. A poller passes
its ChainWatch: each check then lists only what is new (a stray manifest key above a gap ends nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.run.context import RunContext
from diloco.run.fragments import ChainWatch, run_version
from diloco.storage import Manifest, read_latest
from diloco.storage.store import Store


@dataclass(frozen=True)
class Target:
    versions: int  # run.num_versions
    tokens: int = 0  # run.num_tokens (0: no token budget)

    def reached_by(self, manifest: Manifest | None) -> bool:
        """Whether a chain whose newest manifest is `manifest` is done."""
        if manifest is None:
            return False
        return manifest.version >= self.versions or (self.tokens > 0 and manifest.tokens_total >= self.tokens)

    def describe(self) -> str:
        """`50 versions` or `6,000,000 tokens (at most 400 versions)`."""
        if self.tokens > 0:
            return f"{self.tokens:,} tokens (at most {self.versions} versions)"
        return f"{self.versions} versions"


def run_target(ctx: RunContext) -> Target:
    return Target(ctx.cfg.run.num_versions, ctx.cfg.run.num_tokens)


def chain_heads(ctx: RunContext, store: Store | None = None) -> list[Manifest | None]:
    """The newest manifest of every chain of the run (the root, or each fragment's), in fragment order."""
    store = store or ctx.store
    if not ctx.fragments:
        return [read_latest(store, ctx.keys)]
    return [read_latest(store, ctx.keys.for_fragment(p)) for p in range(len(ctx.fragments))]


@dataclass(frozen=True)
class Progress:
    version: int | None  # the run's version (fragments: the slowest fragment's); None before version 0
    tokens: int  # merged by the run (the fewest any chain merged; 0 without a token budget: not read)
    reached: bool  # every chain reached the target


def run_progress(ctx: RunContext, store: Store | None = None, target: Target | None = None,
                 watch: ChainWatch | None = None) -> Progress:
    """Where the run stands against `target` (default: the run's own), from one read of its chains: their
    versions alone without a token budget (one listing per chain), their newest manifests with one. `watch`: a
    poller's ChainWatch (each chain listed after the version it knows; a manifest read only when it moved)."""
    target = target or run_target(ctx)
    if target.tokens <= 0:
        version = watch.run_version() if watch is not None else run_version(ctx, store)
        return Progress(version, 0, version is not None and version >= target.versions)
    heads = watch.heads() if watch is not None else chain_heads(ctx, store)
    if any(h is None for h in heads):
        return Progress(None, 0, False)
    return Progress(min(h.version for h in heads), min(h.tokens_total for h in heads),
                    all(target.reached_by(h) for h in heads))


def _fewest_tokens(heads: list[Manifest | None]) -> int:
    return 0 if any(h is None for h in heads) else min(h.tokens_total for h in heads)


def run_tokens(ctx: RunContext, store: Store | None = None) -> int:
    """Tokens merged by the run: the fewest any chain has merged (0 before version 0)."""
    return _fewest_tokens(chain_heads(ctx, store))


def target_reached(ctx: RunContext, store: Store | None = None, target: Target | None = None,
                   watch: ChainWatch | None = None) -> bool:
    """Whether every chain of the run has reached `target` (default: the run's own); `watch`: see
    run_progress."""
    return run_progress(ctx, store, target, watch).reached

"""The chain's state a merger holds between merges: the params and outer state of its newest version, rebuilt
from the log when it does not hold them (diloco.merger.replay) and handed to each merge whole (it updates
them in place).

Contract: between merges the state held is the chain's at `manifest`'s version, bit for bit (invariant 8,
docs/STORAGE.md): `load(manifest)` moves it there — by replaying the merges after the version held, or from
the checkpoint at or before `manifest` when it holds none (at start, after a lost race or a failed commit)
— and every replayed update is checked against the committed one. `take()` hands both to a merge and holds
nothing until `keep()` is given the committed result: the outer step runs in place, so a merge that then
fails leaves no state to go back to, only the log. Nothing here ever holds tensors of two versions at once.
"""

from __future__ import annotations

import torch

from diloco.merger.replay import ChainState, recover
from diloco.merger.step import OuterState
from diloco.run.context import RunContext
from diloco.storage import Manifest
from diloco.training.fp64 import Arena
from diloco.training.tensors import Tensors, same_layout


class VersionState:
    def __init__(self, ctx: RunContext, arena: Arena | None = None) -> None:
        self.ctx, self.arena = ctx, arena  # the merger's fp64 block, for the merges a load replays
        self.held: ChainState | None = None
        self.manifest: Manifest | None = None
        self.last_load: ChainState | None = None  # how the last load got there (replayed merges, seconds)

    def load(self, manifest: Manifest) -> dict[str, float]:
        """Hold the state of `manifest`'s version (replayed from the one held, or from a checkpoint); returns
        its grace window's moving averages."""
        held, self.held = self.held, None
        if held is not None and held.manifest.version > manifest.version:
            held = None  # a newer state than the chain's newest cannot be: rebuilt from the checkpoint
        state = recover(self.ctx, manifest, held, arena=self.arena)
        self.held, self.manifest, self.last_load = state, manifest, state
        return dict(state.ema)

    @property
    def holds(self) -> bool:
        return self.held is not None

    @property
    def params(self) -> Tensors:
        if self.held is None:
            raise RuntimeError(f"run {self.ctx.run_id}: the merger holds no state (load() first)")
        return self.held.params

    @property
    def outer(self) -> OuterState:
        if self.held is None:
            raise RuntimeError(f"run {self.ctx.run_id}: the merger holds no state (load() first)")
        if self.held.outer is None:
            self.held.outer = OuterState.zeros_like(self.held.params)
        return self.held.outer

    def layout(self) -> Tensors:
        """Names and shapes of the version's tensors, in order (meta tensors from run.json's layout; the
        params themselves for a run without one): what deltas are checked against before params are used."""
        if not self.ctx.layout:
            return self.params
        return {e["name"]: torch.empty(e["shape"], device="meta") for e in self.ctx.layout}

    def snapshot(self) -> tuple[Manifest, Tensors, OuterState | None, dict[str, float]]:
        """(manifest, params, outer state, moving averages) held now: what a checkpoint of it writes."""
        held = self.held
        return held.manifest, held.params, held.outer, held.ema

    def take(self, layout: Tensors) -> tuple[Tensors, OuterState | None]:
        """The params and the outer state (None: zeros) for a merge to consume; held no more."""
        params = self.params
        if not same_layout(params, layout):
            raise RuntimeError(f"run {self.ctx.run_id} version {self.manifest.version}: the held tensors "
                               "differ from run.json's layout")
        outer = self.held.outer
        self.held = None
        return params, outer

    def keep(self, manifest: Manifest, params: Tensors, outer: OuterState, ema: dict[str, float]) -> None:
        """A committed merge's version and its new tensors."""
        self.held, self.manifest = ChainState(manifest, params, outer, dict(ema)), manifest

    def forget(self) -> None:
        """Hold nothing (the next load rebuilds from the log)."""
        self.held = None

"""The merger's copy of one committed version's tensors: the params and the outer state, read when a merge
needs them and handed over to it whole (the merge updates them in place).

Contract: `reset(manifest)` reads only the outer state's bytes (checked; their header carries the grace
window's moving averages), `params` and `outer` read and decode on first use, `take()` hands both to a merge
and forgets them, so after a merge that failed they are read again from the bucket; `keep(result)` holds a
committed merge's new ones. Nothing here ever holds tensors of two versions at once.
"""

from __future__ import annotations

import torch

from diloco.merger.step import OuterState
from diloco.run.context import RunContext
from diloco.run.objects import decode_tensors, read_checked, read_committed
from diloco.storage import Manifest
from diloco.storage.codec import read_header
from diloco.training.tensors import Tensors, same_layout


class VersionState:
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.manifest: Manifest | None = None
        self._params: Tensors | None = None
        self._outer: OuterState | None = None
        self._outer_data: bytes | None = None  # the outer state's checked bytes, until decoded

    def reset(self, manifest: Manifest) -> dict[str, float]:
        """Forget the tensors held, read `manifest`'s outer bytes; returns their moving averages ({} if none)."""
        self.manifest, self._params = manifest, None
        return self._read_outer()

    def _read_outer(self) -> dict[str, float]:
        manifest = self.manifest
        self._outer, self._outer_data = None, None
        if not manifest.outer_key:
            return {}
        data = read_checked(self.ctx.store, manifest.outer_key, manifest.outer_checksum)
        self._outer_data = data
        return {k: float(v) for k, v in read_header(data).meta.get("ema", {}).items()}

    @property
    def params(self) -> Tensors:
        if self._params is None:
            manifest = self.manifest
            _, self._params = read_committed(self.ctx.store, manifest.params_key, fingerprint=self.ctx.fingerprint,
                                             checksum=manifest.params_checksum,
                                             what=f"version {manifest.version}'s params")
        return self._params

    @property
    def outer(self) -> OuterState:
        if self._outer is None:
            outer = self._decode_outer()
            self._outer = OuterState.zeros_like(self.params) if outer is None else outer
        return self._outer

    def _decode_outer(self) -> OuterState | None:
        """The outer state, its bytes decoded if need be (None: the version has none, its state is zeros)."""
        if self._outer is not None:
            return self._outer
        if self._outer_data is None and self.manifest.outer_key:
            self._read_outer()  # taken by a merge that then failed: read again
        if self._outer_data is None:
            return None
        _, raw = decode_tensors(self._outer_data, fingerprint=self.ctx.fingerprint)
        self._outer_data = None
        return OuterState.from_tensors(raw, self.params)

    def layout(self) -> Tensors:
        """Names and shapes of the version's tensors, in order (meta tensors from run.json's layout; the
        params themselves for a run without one): what deltas are checked against before params are read."""
        if not self.ctx.layout:
            return self.params
        return {e["name"]: torch.empty(e["shape"], device="meta") for e in self.ctx.layout}

    def take(self, layout: Tensors) -> tuple[Tensors, OuterState | None]:
        """The params and the outer state (None: zeros) for a merge to consume; forgotten here."""
        params = self.params
        if not same_layout(params, layout):
            raise RuntimeError(f"run {self.ctx.run_id} version {self.manifest.version}: the params object's "
                               "tensors differ from run.json's layout")
        outer = self._decode_outer()
        self._params, self._outer, self._outer_data = None, None, None
        return params, outer

    def forget(self, manifest: Manifest | None = None) -> None:
        """Drop the tensors held (a merge is writing them away), moving on to `manifest` if given; they are
        read again (from self.manifest) if needed."""
        self.manifest = manifest or self.manifest
        self._params, self._outer, self._outer_data = None, None, None

    def keep(self, manifest: Manifest, params: Tensors, outer: OuterState) -> None:
        """A committed merge's version and its new tensors."""
        self.manifest, self._params, self._outer, self._outer_data = manifest, params, outer, None

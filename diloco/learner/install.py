"""Installing newer versions (a section of diloco.learner.learner.Learner): a cheap probe for version base+1
of a lane's chain, its compact updates (or full params when far behind) fetched on the training thread or by
the lane's prefetcher, and the carry `theta_p = G_p + (theta_p - r_p)`, `r_p = G_p`; `sync` mode's wait for
the version deciding a delta.

Contract: a lane installs no earlier than fragments.overlap_steps after its last ship (the whole model: at
every probe); storage trouble at a probe is logged and recorded (`install_failed`) and training goes on; a
corrupt committed object (CorruptObject) propagates. With inner.schedule_clock "run" an install moves the
schedule to the run's clock. A multi-rank learner sends the installed parameters to its other ranks before the
next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from diloco.learner.prefetch import fetch_spilled
from diloco.learner.world import PARAMS
from diloco.storage import Manifest, StorageError, latest_version, manifest_exists, read_latest
from diloco.storage.codec import CodecError
from diloco.training.tensors import Tensors

log = logging.getLogger("diloco.learner")


class InstallSection:
    """Learner.maybe_install, install, wait_for_decision and the lanes' sync waits."""

    def maybe_install(self) -> int | list[int] | None:
        """Probe every lane past its overlap for its next version and install the newest; with a prefetcher,
        install what it fetched (no request to the bucket on this thread). The whole model: the version
        installed, or None; fragments: the lanes moved."""
        moved: list[tuple[int, int]] = []
        for lane in self.lanes.lanes:
            if not self.lanes.may_install(lane.index, self.steps_done):
                continue
            prefetcher = self.lane_prefetch.get(lane.index)
            if prefetcher is not None:
                fetched = prefetcher.take()
                if fetched is not None and fetched[0] > lane.base:
                    self._put_lane(lane.index, *fetched, prefetcher.taken_manifest)
                    moved.append((lane.index, fetched[0]))
                continue
            keys = self.chain_keys(lane.index)
            try:
                if not manifest_exists(self.quick, keys, lane.base + 1):
                    continue
                latest = latest_version(self.ctx.store, keys, after=lane.base)  # listed from what it holds
                if latest is None or latest <= lane.base:
                    continue
                moved.append((lane.index, self.install(latest, index=lane.index)))
            except (StorageError, CodecError) as err:
                log.warning("learner %s: %sprobe/install failed (%s); training on", self.name,
                            "" if self.whole else f"fragment {lane.index} ", err)
                self.events.emit("install_failed", learner=self.name, **self.tag(lane.index),
                                 version=lane.base, reason=str(err))
        if self.whole:
            return moved[0][1] if moved else None
        return [index for index, _ in moved]

    def install(self, version: int, glob: Tensors | None = None, manifest: Manifest | None = None,
                index: int = 0) -> int:
        """Move lane `index` (the whole model's: 0) to `version` (`glob`: G_version already fetched,
        `manifest` its manifest): theta_p = G + (theta_p - r_p) (carry) or G (overwrite); r_p = G. With
        inner.schedule_clock "run", the schedule moves to the run's clock. Returns the version."""
        lane = self.lanes.lanes[index]
        fetched_here = glob is None
        if fetched_here:
            glob, manifest = fetch_spilled(self.chain(index), self.ctx.store, lane.base, lane.glob, version,
                                           self.cfg.learner.max_updates_behind, self.lanes.spill)
        self._put_lane(index, version, glob, manifest)
        prefetcher = self.lane_prefetch.get(index)
        if fetched_here and prefetcher is not None:  # installed another way: its prefetcher fetches from here
            prefetcher.rebase(version, glob)
        return version

    def _put_lane(self, index: int, version: int, glob: Tensors, manifest: Manifest | None) -> None:
        """Lane `index` to `version` (its global `glob`, fetched; `manifest` its manifest) in the model's
        parameters; the run's clock from its tokens (each chain merges every step's tokens once)."""
        self.settle(index)  # the lane's shipped deltas' error feedback is in r_p before the carry reads it
        previous = self.lanes.lanes[index].base
        merged = None if manifest is None else manifest.cursors.get(self.name, -1)
        self.lanes.install(index, version, glob, self._live(), merged)
        if self.world is not None:
            self.world.pending |= PARAMS
        self.events.emit("install", learner=self.name, **self.tag(index), version=version, previous=previous,
                         behind=version - previous)
        if manifest is not None:
            self.run_clock(manifest.tokens_total)

    def wait_for_decision(self, seq: int, timeout_s: float, should_stop: Callable[[], bool] = lambda: False,
                          index: int = 0) -> int | None:
        """Sync mode: block until a version of lane `index`'s chain decides its delta `seq`, then install it;
        the lane's version, or None when the time ran out or should_stop said so."""
        self.settle()
        self.publisher.drain()
        keys, deadline, first = self.chain_keys(index), time.time() + timeout_s, True
        while time.time() < deadline and not should_stop():
            self.heartbeat("waiting")
            try:
                base = self.lanes.lanes[index].base
                # listed from the version it holds (never the whole chain): the first time whatever is there
                # (the held version may decide `seq`), then only after a HEAD found a newer one
                manifest = None
                if first or manifest_exists(self.quick, keys, base + 1):
                    manifest = read_latest(self.ctx.store, keys, after=base)
                first = False
                if manifest is not None and manifest.cursors.get(self.name, -1) >= seq:
                    return self.install(manifest.version, index=index) if manifest.version > base else base
            except StorageError as err:
                log.warning("learner %s: waiting for version failed (%s)", self.name, err)
            time.sleep(self.cfg.merger.poll_interval_s)
        return None

    def wait_for_decisions(self, timeout_s: float | None = None) -> None:
        """Sync mode with fragments: tau steps after a lane ships, block until its chain's version deciding
        it, then install it."""
        timeout_s = timeout_s or self.cfg.merger.quorum_timeout_s * 4
        for index, seq in sorted(self.awaiting.items()):
            if self.lanes.may_install(index, self.steps_done):
                self.wait_for_decision(seq, timeout_s, index=index)
                del self.awaiting[index]

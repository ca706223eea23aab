"""The merger's one loop: a merger process owns a set of chains (a shard) and merges each chain once it is
due, never letting one chain's wait hold back another's merge.

Contract: shard s of `merger.shards` owns the fragments p with p % shards == s; a whole-model run (P = 1)
has one chain, the root's, owned by its one merger (shard 0 of 1). Every chain waits by the same rule
(Merger.due: quorum, timeout, grace window) and is merged by the one deterministic Merger on its own
context (its keys, its layout); a commit is the exclusive create of that chain's next manifest, so two
processes of one shard race safely (exactly one commit per version, the loser rebuilds the winner's state
from the log), and a shard never touches another's chains. Memory: every chain keeps its params and outer
state between merges (12 B per parameter it owns: shard s of S holds the state of its P/S fragments),
rebuilt from the newest checkpoint and the merges after it at start; the process's one checkpoint thread
writes each chain's state every `state.checkpoint_every` versions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from diloco.merger.checkpointer import ChainCheckpoints, CheckpointWriter
from diloco.merger.merger import CONTROLS_EVERY_S, Merger
from diloco.merger.step import MergeArenas
from diloco.run.context import RunContext
from diloco.run.controls import OpsFeed
from diloco.run.events import EventLog
from diloco.run.fragments import fragment_context, num_fragments, shard_merger_id
from diloco.run.target import Target
from diloco.storage import Manifest, StorageError
from diloco.storage.errors import Backoff
from diloco.storage.heads import write_heads
from diloco.training.fragments import owned_by

log = logging.getLogger("diloco.merger")
STORAGE_BACKOFF_S = (0.5, 10.0)  # first wait, cap (doubled per failed pass) while the bucket is in trouble

MergeUnit = Callable[[Merger, Callable[[], bool]], Manifest | None]


def merge_once(merger: Merger, should_stop: Callable[[], bool]) -> Manifest | None:
    """The default unit of work: one merge of a chain (launch.Units.merge wraps it as a Prefect task)."""
    return merger.merge_once(should_stop)


class ShardMerger:
    """The chains one merger process owns (`shard` of `merger.shards`; the root chain alone at P = 1), each
    driven by its own Merger. Drive with poll_once() in a loop (run_merger), or merge_waiting() at a run's
    end; close() waits for the checkpoints in flight."""

    def __init__(self, ctx: RunContext, shard: int = 0, merger_id: str | None = None,
                 events: EventLog | None = None, stage_hook: Callable[[str], None] | None = None,
                 keyring: dict[str, list[bytes]] | None = None) -> None:
        self.ctx, self.shard = ctx, shard
        self.merger_id = merger_id or shard_merger_id(shard)
        self.events = events or EventLog(None, None, self.merger_id)
        owned = owned_by(shard, ctx.cfg.merger.shards if ctx.fragments else 1, num_fragments(ctx))
        self.writer = CheckpointWriter()  # one thread writes every owned chain's checkpoints, one at a time
        ops = OpsFeed(ctx.store, ctx.keys, CONTROLS_EVERY_S)  # the run's ops: one listing serves every chain
        arenas = MergeArenas()  # the chains merge one at a time: kept blocks of the largest chain's size
        self.chains = {}
        for index in owned:
            chain = fragment_context(ctx, index)
            checkpoints = ChainCheckpoints(chain, self.writer, self.merger_id, self.events, stage_hook)
            self.chains[index] = Merger(chain, self.merger_id, events=self.events, stage_hook=stage_hook,
                                        keyring=keyring, checkpoints=checkpoints, ops=ops, arenas=arenas)
        self._stale = set(owned)  # chains to (re)load before their next use: at start, after a storage error

    @property
    def fragments(self) -> list[int]:
        """The indices of the chains this merger owns (fragment order; [0] for the root chain)."""
        return list(self.chains)

    def chain(self, index: int) -> Merger:
        """The chain's Merger, loaded on first use (and again after a storage error)."""
        merger = self.chains[index]
        if index in self._stale:
            merger.load()
            self._stale.discard(index)
        return merger

    def version(self, index: int) -> int:
        return self.chain(index).version

    def reload(self) -> None:
        """Read every chain's newest version again before its next use (after storage trouble)."""
        self._stale = set(self.chains)

    def done(self, target: Target) -> bool:
        """Every chain reached the target."""
        return all(target.reached_by(self.chain(index).manifest) for index in self.chains)

    def poll_once(self, should_stop: Callable[[], bool] = lambda: False, target: Target | None = None,
                  merge: MergeUnit | None = None) -> list[Manifest]:
        """One pass over the chains: each that is due (and short of the target) is merged by `merge`."""
        merged = []
        for index in self.chains:
            if should_stop():
                break
            chain = self.chain(index)
            if target is not None and target.reached_by(chain.manifest):
                continue
            if chain.due():
                manifest = self.merge_chain(index, should_stop, merge)
                if manifest is not None:
                    merged.append(manifest)
        return merged

    def merge_chain(self, index: int, should_stop: Callable[[], bool] = lambda: False,
                    merge: MergeUnit | None = None) -> Manifest | None:
        """One merge of the chain by `merge` (default merge_once: it waits until the chain is due); None when
        another merger committed first (reloaded) or nothing was taken."""
        chain = self.chain(index)
        # no gc.collect() after it: a merge frees its tensors by reference counting (no reference cycle holds
        # one: test_hostile_deltas), and a full collection costs ~60 ms in a busy process, per chain
        manifest = (merge or merge_once)(chain, should_stop)
        if manifest is not None and self.ctx.fragments:
            self._write_heads()
        return manifest

    def _write_heads(self) -> None:
        """The newest version of every chain it holds, for the learners' one poll (diloco.storage.heads): a
        hint, so a failed write is logged, never raised."""
        versions = {i: m.version for i, m in self.chains.items() if i not in self._stale}
        try:
            write_heads(self.ctx.store, self.ctx.keys, self.shard, self.merger_id, versions)
        except StorageError as err:
            log.warning("%s: heads not written (%s); learners' lanes poll by themselves", self.merger_id, err)

    def close(self) -> None:
        """Wait for the checkpoints in flight to land (before the process ends)."""
        self.writer.close()
        for merger in self.chains.values():
            merger.checkpoints.landed()

    def merge_waiting(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Merge every chain's waiting deltas now, whatever its quorum and grace window, until none waits (a
        run's end: a cohort's last ships below the quorum); returns the merges. A merge that commits nothing
        is an error: its deltas would wait for ever."""
        merges = 0
        for index in self.chains:
            chain = self.chain(index)
            while not should_stop() and chain.take_waiting():
                if self.merge_chain(index) is None:
                    raise RuntimeError(f"run {self.ctx.run_id} {chain.chain}: a merge of its waiting deltas "
                                       "committed nothing")
                merges += 1
        return merges

    def sleep_s(self) -> float:
        """How long the loop sleeps after a pass that merged nothing: a poll interval, less when a chain's
        grace window ends sooner."""
        loaded = [merger for index, merger in self.chains.items() if index not in self._stale]
        return min((merger.sleep_s() for merger in loaded), default=self.ctx.cfg.merger.poll_interval_s)


def run_merger(shard: ShardMerger, *, max_merges: int | None = None, target_version: int | None = None,
               target_tokens: int = 0, should_stop: Callable[[], bool] = lambda: False,
               on_merge: Callable[[Manifest], None] | None = None, merge: MergeUnit | None = None) -> int:
    """Merge the shard's chains until stopped, every one reached the target (the version, or `target_tokens` >
    0 merged), or max_merges merges were made. `merge` is the unit a Prefect flow wraps as a task (default
    merge_once): it runs once a chain is due, never per poll."""
    merges, backoff = 0, Backoff(*STORAGE_BACKOFF_S)
    target = None if target_version is None else Target(target_version, target_tokens)
    while not should_stop():
        try:
            if target is not None and shard.done(target):
                break
            if max_merges is not None and merges >= max_merges:
                break
            merged = shard.poll_once(should_stop, target, merge)
            backoff.reset()
        except StorageError as err:
            wait_s = backoff.next_s()
            log.warning("merger %s: merge failed on storage (%s); retrying in %.1fs", shard.merger_id, err,
                        wait_s)
            shard.events.emit("storage_error", reason=str(err))
            shard.reload()
            time.sleep(wait_s)
            continue
        merges += len(merged)
        for manifest in merged:
            if on_merge:
                on_merge(manifest)
        if not merged:
            time.sleep(shard.sleep_s())
        shard.events.flush()
    shard.close()  # the checkpoints in flight land before the process ends
    shard.events.flush()
    return merges

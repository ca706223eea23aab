"""A merger shard: the fragments p with p % merger.shards == shard, merged one at a time on their own chains.

Contract: each fragment is merged by the one deterministic Merger on its fragment context (its namespace,
its layout), loaded for that merge and released after it, so the shard holds O(one fragment), never the whole
model; a commit is the exclusive create of the fragment's next manifest, so two processes of one shard race
safely (exactly one commit per fragment version, the loser reloads); a shard never touches another's chains.
"""

from __future__ import annotations

import gc
import logging
import re
import time
from collections.abc import Callable

from diloco.merger.merger import Merger, Pending
from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.run.fragments import fragment_context, num_fragments, shard_merger_id
from diloco.run.target import Target
from diloco.storage import Manifest, StorageError, manifest_exists, read_latest
from diloco.storage.errors import Backoff
from diloco.storage.keys import parse_delta_key
from diloco.training.fragments import owned_by

log = logging.getLogger("diloco.merger")
STORAGE_BACKOFF_S = (0.5, 10.0)
COLLECT_ABOVE_BYTES = 4 << 20  # fp32 bytes of a fragment from which its merge ends with a full gc.collect()


_SHARD_ID_RE = re.compile(r"merger(?:-[0-9]+)?|merger-s([1-9][0-9]*|0)(?:-[a-z0-9]+)?")


def shard_of_id(merger_id: str) -> int:
    """The shard a merger id names: `merger` (or `merger-<n>`, a second process of it, as a chaos plan's
    second_merger) -> 0; `merger-s<k>` (or `merger-s<k>-<tag>`) -> k; ValueError naming the id otherwise."""
    match = _SHARD_ID_RE.fullmatch(merger_id)
    if match is None:
        raise ValueError(f"merger id {merger_id!r} names no shard: it must be merger[-<n>] or merger-s<k>[-<tag>]")
    return int(match.group(1) or 0)


class FragmentMerger(Merger):
    """The Merger on one fragment's chain. It never blocks for a quorum: its shard decided one is there."""

    waited_s: float = 0.0  # how long the shard saw deltas waiting: the manifest's quorum wait
    keep_state = False  # loaded for one merge and released after it: its state is freed while it is written

    def wait_for_quorum(self, should_stop: Callable[[], bool]) -> tuple[Pending, float] | None:
        if should_stop() or manifest_exists(self.ctx.store, self.ctx.keys, self.version + 1):
            return None
        if self.refresh_policy(force=False).state.paused:
            return None
        pending = self.pending()
        if not any(seqs and self.policy.eligible(name) for name, seqs in pending.ready.items()):
            return None
        return pending, self.waited_s


class ShardMerger:
    """Drive with poll_once() in a loop (run_shard). `shard` of `cfg.merger.shards`."""

    def __init__(self, ctx: RunContext, shard: int = 0, merger_id: str | None = None,
                 events: EventLog | None = None, stage_hook: Callable[[str], None] | None = None,
                 keyring: dict[str, list[bytes]] | None = None) -> None:
        self.ctx, self.shard = ctx, shard
        self.fragments = owned_by(shard, ctx.cfg.merger.shards, num_fragments(ctx))
        self.merger_id = merger_id or shard_merger_id(shard)
        self.events = events or EventLog(None, None, self.merger_id)
        self.stage_hook, self.keyring = stage_hook, keyring
        self.heads: dict[int, Manifest] = {}  # per fragment: its newest manifest (JSON only, no tensors)
        self.first_ready: dict[int, float] = {}  # per fragment: when deltas were first seen waiting
        self.gap_seen: dict[int, dict] = {p: {} for p in self.fragments}  # a Merger's gap timers, kept across merges
        self.keys = {p: fragment_context(ctx, p).keys for p in self.fragments}  # each owned fragment's chain

    def head(self, index: int) -> Manifest:
        """The fragment's newest manifest: cached, re-read when its next version exists."""
        cached, keys = self.heads.get(index), self.keys[index]
        if cached is None or manifest_exists(self.ctx.store, keys, cached.version + 1):
            latest = read_latest(self.ctx.store, keys)
            if latest is None:
                raise RuntimeError(f"run {self.ctx.run_id} fragment {index} has no version 0")
            self.heads[index] = cached = latest
        return cached

    def version(self, index: int) -> int:
        return self.head(index).version

    def _waiting(self, index: int, head: Manifest, barred: set[str]) -> int:
        """Learners not removed or quarantined with a delta after their cursor in the fragment's chain (one
        listing); the barred ones' deltas are rejected by the next merge the others' deltas bring."""
        names = set()
        for key in self.ctx.store.list(self.keys[index].deltas_prefix()):
            parsed = parse_delta_key(key)
            if parsed and parsed[0] not in barred and parsed[1] > head.cursors.get(parsed[0], -1):
                names.add(parsed[0])
        return len(names)

    def merge_waiting(self) -> int:
        """Merge every fragment's waiting deltas now, whatever its quorum, until none waits (a run's end: a
        cohort's last ships below the quorum); returns the merges. A merge that commits nothing is an error: its
        deltas would wait for ever."""
        merges = 0
        for index in self.fragments:
            while self._waiting(index, self.head(index), set()):
                if self.merge_fragment(index, lambda: False) is None:
                    raise RuntimeError(f"fragment {index}: a merge of its waiting deltas committed nothing")
                merges += 1
        return merges

    def due(self, index: int, head: Manifest, now: float) -> bool:
        """A quorum of learners waiting, or any waiting for quorum_timeout_s (the merger's own rule); `head`
        is the fragment's newest manifest (self.head)."""
        cfg = self.ctx.cfg.merger
        members = head.guard.members if head.guard and head.guard.members else self.ctx.learners
        barred = {*head.guard.removed, *head.guard.quarantined} if head.guard else set()
        waiting = self._waiting(index, head, barred)
        if not waiting:
            self.first_ready.pop(index, None)
            return False
        since = self.first_ready.setdefault(index, now)
        return waiting >= min(cfg.quorum, max(1, len(members))) or now - since >= cfg.quorum_timeout_s

    def merge_fragment(self, index: int, should_stop: Callable[[], bool]) -> Manifest | None:
        """Load the fragment, merge it once, release it; None when another merger won or nothing was taken."""
        merger = FragmentMerger(fragment_context(self.ctx, index), self.merger_id, events=self.events,
                                stage_hook=self.stage_hook, keyring=self.keyring)
        merger.gap_seen = self.gap_seen[index]
        merger.waited_s = time.time() - self.first_ready.get(index, time.time())
        merger.load()
        manifest = merger.merge_once(should_stop)
        self.heads[index] = merger.manifest
        if manifest is not None:
            self.first_ready.pop(index, None)
        del merger
        # a merge leaves reference cycles holding its tensors: free them before the next fragment's. A full
        # collection costs ~80 ms in a busy process (4/5 of a 30k-parameter fragment's merge in bench wan), so a
        # small fragment's cycles are left to Python's own collections: they hold a few MB at most
        numel = self.ctx.fragments[index].get("numel") if self.ctx.fragments else None  # run.json's plan
        if numel is None or 4 * numel >= COLLECT_ABOVE_BYTES:
            gc.collect()
        return manifest

    def poll_once(self, should_stop: Callable[[], bool] = lambda: False,
                  target: Target | None = None) -> list[Manifest]:
        """One pass over the shard's fragments: merge each that is due (and short of the target)."""
        merged = []
        for index in self.fragments:
            if should_stop():
                break
            head = self.head(index)  # one read of the fragment's newest version per pass
            if target is not None and target.reached_by(head):
                continue
            if self.due(index, head, time.time()):
                manifest = self.merge_fragment(index, should_stop)
                if manifest is not None:
                    merged.append(manifest)
        return merged

    def done(self, target: Target) -> bool:
        """Every fragment of the shard reached the target."""
        return all(target.reached_by(self.head(p)) for p in self.fragments)


def run_shard(shard: ShardMerger, *, max_merges: int | None = None, target_version: int | None = None,
              target_tokens: int = 0, should_stop: Callable[[], bool] = lambda: False,
              on_merge: Callable[[Manifest], None] | None = None) -> int:
    """Merge the shard's fragments until stopped, every one reached the target (the version, or `target_tokens`
    > 0 merged), or max_merges were made."""
    merges, backoff = 0, Backoff(*STORAGE_BACKOFF_S)
    target = None if target_version is None else Target(target_version, target_tokens)
    while not should_stop():
        try:
            if target is not None and shard.done(target):
                break
            if max_merges is not None and merges >= max_merges:
                break
            merged = shard.poll_once(should_stop, target)
            backoff.reset()
        except StorageError as err:
            wait_s = backoff.next_s()
            log.warning("shard %d: merge failed on storage (%s); retrying in %.1fs", shard.shard, err, wait_s)
            shard.events.emit("storage_error", reason=str(err))
            shard.heads.clear()
            time.sleep(wait_s)
            continue
        merges += len(merged)
        for manifest in merged:
            if on_merge:
                on_merge(manifest)
        if not merged:
            time.sleep(shard.ctx.cfg.merger.poll_interval_s)
        shard.events.flush()
    shard.events.flush()
    return merges

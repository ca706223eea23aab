"""What a chain's merger waits for before it merges: the deltas after its cursors, a quorum of learners, and
the adaptive grace window after the quorum — one rule for every chain (the root's, each fragment's).

Contract: `deltas_after` lists O(learners + new deltas) a poll, never every delta of the run; a `Wait` is one
chain's wait for its next merge, advanced by non-blocking looks (`Merger.due`), so a merger that owns several
chains never lets one chain's wait hold back another's merge. It is due once a quorum of eligible learners has
deltas pending (or, after `quorum_timeout_s` from its start, any has), then once its grace window is over or
every learner that may publish has a delta pending (nobody is left to wait for).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from diloco.storage import RunKeys, Store
from diloco.storage.keys import InvalidName, parse_delta_key

# seqs a member may be ahead of its cursor: learner.max_unmerged (or this when 0, no bound) + SEQ_MARGIN, for
# the deltas uploading and a deferral's slack; a key further ahead is no delta this merger decides (ignored,
# reported)
UNBOUNDED_AHEAD, SEQ_MARGIN = 64, 16


def plausible_ahead(max_unmerged: int) -> int:
    """How far past its cursor a member's next deltas can be."""
    return (max_unmerged or UNBOUNDED_AHEAD) + SEQ_MARGIN


@dataclass
class Pending:
    """Deltas the merger may take now: per learner, the contiguous seqs after its cursor; per learner the one
    range of seqs a gap declared lost (first, last); a name never admitted: the range of its keys, rejected by
    one decision and never listed again by this merger; the keys it ignores (learner -> seqs): seqs further
    past their member's cursor than they can be."""

    ready: dict[str, list[int]] = field(default_factory=dict)
    lost: dict[str, tuple[int, int]] = field(default_factory=dict)
    ignored: dict[str, list[int]] = field(default_factory=dict)
    # a never-admitted name's seqs: one decision
    strangers: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def num_learners(self) -> int:
        return sum(1 for seqs in self.ready.values() if seqs)


def deltas_after(store: Store, keys: RunKeys, cursors: dict[str, int],
                 skip: frozenset[str] | set[str] = frozenset(),
                 learners: Iterable[str] | None = None) -> dict[str, list[int]]:
    """Per learner, the seqs of its deltas after its cursor (sorted; a learner without any: absent). One
    listing of the learners' folders (or the folders of `learners` only, when given), then one per learner
    from its cursor's key on (S3's StartAfter): O(learners + new deltas) a poll, not O(every delta of the
    run). A folder that is not a learner's name holds no delta; the folders in `skip` (strangers already
    decided) are not listed again."""
    found: dict[str, list[int]] = {}
    for learner in store.folders(keys.deltas_prefix()) if learners is None else learners:
        if learner in skip:
            continue
        try:
            prefix = keys.deltas_prefix(learner)
        except InvalidName:
            continue
        cursor = cursors.get(learner, -1)
        for key in store.list(prefix, keys.delta(learner, cursor) if cursor >= 0 else ""):
            parsed = parse_delta_key(key)
            if parsed and parsed[0] == learner and parsed[1] > cursor:
                found.setdefault(learner, []).append(parsed[1])
    return found


@dataclass
class Wait:
    """One chain's wait for its next merge (times are time.time())."""

    since: float  # when the chain began waiting: after its last commit, or its (re)load
    quorum_at: float | None = None  # when the quorum (or its timeout) was reached: the grace window starts
    grace_s: float = 0.0  # the window's length, fixed when it starts
    ready_at: float | None = None  # when the wait ended
    ready: Pending | None = None  # what it ended with: the merge takes exactly these deltas

    def quorum_reached(self, num_ready: int, quorum: int, timeout_s: float, now: float) -> bool:
        """A quorum of eligible learners with deltas pending, or at least one once timeout_s have passed."""
        if num_ready >= quorum or (num_ready and now - self.since >= timeout_s):
            self.quorum_at = now
            return True
        return False

    def end(self, pending: Pending, now: float) -> None:
        self.ready, self.ready_at = pending, now

    def grace_over(self, now: float) -> bool:
        return self.quorum_at is not None and now - self.quorum_at >= self.grace_s

    @property
    def quorum_wait_s(self) -> float:
        return (self.quorum_at or self.since) - self.since

    @property
    def grace_waited_s(self) -> float:
        return 0.0 if self.ready_at is None or self.quorum_at is None else self.ready_at - self.quorum_at

    def sleep_s(self, poll_s: float, now: float) -> float:
        """How long to sleep before the next look: a poll interval, less when the grace window ends sooner."""
        if self.quorum_at is None:
            return poll_s
        return max(0.0, min(poll_s, self.quorum_at + self.grace_s - now))

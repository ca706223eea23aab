"""Where a learner stands on one chain, besides its model and optimizer: the learner state object (DESIGN §5).

Contract: `base` is the version the reference builds on, `glob` that version's parameters, `ref` (r) the
global plus everything shipped since; theta lives in the model. `seq` is the next delta's number, never
reused. The steps and tokens since the last delta are the progress that ships with the next one. A lane
(diloco.learner.lanes) is one; the whole model is one lane, a fragmented learner has one per fragment chain
(`over` sums them up for its status). With theta, the optimizer and the data cursor, the lanes' states are
all a save needs (diloco.learner.local_state).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.training.tensors import Tensors

# probes and heartbeats on the training thread, and a resume's check of the bucket: one quick retry, then go
# on (train on, the next probe soon; resume from local state)
QUICK_RETRIES = 1


@dataclass
class LearnerState:
    base: int = -1  # the global version r builds on (-1: not joined)
    seq: int = 0  # the next delta's seq
    glob: Tensors = field(default_factory=dict)  # the installed global version's parameters
    ref: Tensors = field(default_factory=dict)  # r: glob plus everything shipped since it was installed
    steps_since_publish: int = 0  # progress in r - theta not shipped yet ...
    tokens_since_publish: int = 0  # ... and the tokens it was made of
    merged: int | None = None  # own seqs up to this one decided by version `base` (its cursor); None: unknown

    def unmerged(self) -> int:
        """Own deltas shipped and not decided by version `base` (0 when that is not known: a resume from a
        local state saved before it kept the count)."""
        return 0 if self.merged is None else max(self.seq - 1 - self.merged, 0)

    def reported_unmerged(self) -> int | None:
        """What the status reports: unmerged(), or None when it is not known."""
        return None if self.merged is None else self.unmerged()

    @classmethod
    def at_version(cls, version: int, params: Tensors, next_seq: int,
                   merged: int | None = None) -> LearnerState:
        """Just joined at `version` (`merged`: this learner's cursor in it): r = the global (the same tensors:
        a lane adopting the state keeps r apart from G, diloco.learner.lanes), nothing unshipped."""
        return cls(base=version, seq=next_seq, glob=params, ref=params, merged=merged)

    def meta(self) -> dict:
        """The JSON part of a save (the tensors glob and ref are saved beside it)."""
        return {"next_seq": self.seq, "base_version": self.base,
                "steps_since_publish": self.steps_since_publish,
                "tokens_since_publish": self.tokens_since_publish, "merged": self.merged}

    @classmethod
    def from_saved(cls, meta: dict, glob: Tensors, ref: Tensors) -> LearnerState:
        """Back from a save's meta and tensors; KeyError/ValueError when the meta is not a save's."""
        merged = meta.get("merged")  # its cursor in version base: back-pressure holds at once after a resume
        return cls(base=int(meta["base_version"]), seq=int(meta["next_seq"]), glob=glob, ref=ref,
                   steps_since_publish=int(meta.get("steps_since_publish", 0)),
                   tokens_since_publish=int(meta.get("tokens_since_publish", 0)),
                   merged=None if merged is None else int(merged))

    @classmethod
    def over(cls, lanes: list[LearnerState]) -> LearnerState:
        """The whole learner over several chains' states (what its status reports): the oldest base, the seqs
        summed, the most unshipped steps, and `merged` such that unmerged() is the chains' unmerged summed
        (None when one chain's is not known). No tensors."""
        seq = sum(lane.seq for lane in lanes)
        known = all(lane.merged is not None for lane in lanes)
        return cls(base=min(lane.base for lane in lanes), seq=seq,
                   steps_since_publish=max(lane.steps_since_publish for lane in lanes),
                   tokens_since_publish=max(lane.tokens_since_publish for lane in lanes),
                   merged=seq - 1 - sum(lane.unmerged() for lane in lanes) if known else None)

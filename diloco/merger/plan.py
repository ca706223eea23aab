"""One merge, decided and stepped, before its objects and its manifest are written: a `MergePlan`, and the
manifest that commits it on top of its parent.

Contract: a plan holds what the merge decided (every delta's decision, the step's result, the guard state
after it, the control ops it applied, the outlier statistics) and how long it waited (quorum, grace window);
`manifest` only assembles the record — the cursors moved past every decided seq, the tokens merged added — and
writes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from diloco.merger.step import StepResult
from diloco.storage import DeltaDecision, Manifest
from diloco.storage.manifest import ControlEntry, GuardState


@dataclass
class MergePlan:
    decisions: list[DeltaDecision]  # every delta this merge decided: merged, rejected or lost
    result: StepResult  # the outer step: update bytes, new global, outer state, weights, norm, share, buffers
    num_learners: int  # learners merged (each learner's deltas are one group)
    quorum_wait_s: float  # from the start of the wait to the quorum (or its timeout)
    grace_s: float  # the grace window waited after it
    started_at: float  # when reading the deltas began: the merge time counts from here
    phase_times: list[float]  # the merged deltas' phase times (the grace window's moving average)
    guard: GuardState  # the guard state after this merge (trust/guard.py: fold)
    controls: list[ControlEntry]  # the control ops this merge applied, as filed
    stats: dict[str, float]  # the outlier rule's median and bound, once it applies
    # the tokens merged, each learner's as counted within the run's counter bounds (GradientStream.tokens):
    # no learner's counters end a token budget or move the schedule clock
    merged_tokens: int

    def manifest(self, parent: Manifest, merger_id: str, objects: dict[str, str], merge_s: float,
                 update_bytes: int) -> Manifest:
        """The record of version parent + 1; `objects`: its keys and checksums (params, update, outer,
        buffers)."""
        cursors = dict(parent.cursors)
        for d in self.decisions:
            if d.check == "admission" and d.learner not in cursors:
                continue  # a name never admitted gets no cursor: manifests do not carry strangers on
            cursors[d.learner] = max(cursors.get(d.learner, -1), d.last_seq)
        result = self.result
        return Manifest(
            run_id=parent.run_id, version=parent.version + 1, parent=parent.version, created_at=time.time(),
            merger_id=merger_id, decisions=self.decisions, cursors=cursors,
            tokens_total=parent.tokens_total + self.merged_tokens,
            timing={"quorum_wait_s": self.quorum_wait_s, "grace_s": self.grace_s, "merge_s": merge_s},
            stats={"update_norm": result.update_norm, "num_learners": float(self.num_learners),
                   "round_share": result.scale, "update_bytes": float(update_bytes), **self.stats},
            guard=self.guard, controls=self.controls, **objects,
        )

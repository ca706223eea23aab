"""The merge's guard state: who may publish (members, removed, quarantined), the live settings, the pause,
the window of recently merged norms — folded version by version from the control ops and the decisions.

Contract: pure and deterministic — `policy_after(state, entries, cfg)` applies a merge's control ops and
`fold(state, decisions, version, cfg)` its decisions; the merger and `audit` call the same two functions on
the same recorded inputs (the parent manifest's GuardState, this manifest's controls and decisions), so the
replay reproduces every GuardState exactly. A bad op is recorded as refused, never applied.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.configs import Config, ConfigError
from diloco.storage import DeltaDecision, Manifest
from diloco.storage.keys import InvalidName, validate_learner_name
from diloco.storage.manifest import ControlEntry, GuardState
from diloco.storage.records import ControlOp, RecordError

# What `diloco set` may change while a run goes on, effective from the next merge. Timing knobs change when a
# merge happens; the others change its math and are replayed by audit with the recorded values.
LIVE_SETTINGS = (
    "merger.quorum", "merger.quorum_timeout_s", "merger.grace_gamma", "merger.grace_cap_s",
    "merger.gap_timeout_s", "merger.poll_interval_s", "merger.max_delta_bytes",
    "merger.outlier_rule", "merger.outlier_threshold", "merger.outlier_window", "merger.outlier_min_samples",
    "merger.quarantine_after",
    "outer.lr", "outer.momentum", "outer.max_staleness", "outer.staleness_power",
)
# Rejections that say something is wrong with what a learner sends (not that it is slow): they count toward
# quarantine. A clipped delta counts too (it was an outlier). Not a bad signature (with signing on, what fails
# it was not written with the learner's key: anyone who can write to the bucket could otherwise have the key
# holder quarantined with three replayed deltas), nor a size refused by the live setting (max_delta_bytes is
# the operator's): those are rejected and reported (`diloco status`, the merger's `rejected` events), never
# the learner's streak.
INTEGRITY_CHECKS = frozenset({"codec", "invalid", "outlier"})


def initial_state(learners: list[str]) -> GuardState:
    """Before any merge: run.json's learners, nothing quarantined, an empty window."""
    return GuardState(members=sorted(set(learners)))


def state_of(manifest: Manifest, learners: list[str]) -> GuardState:
    """The guard state after `manifest` (a manifest without one: the initial state)."""
    return manifest.guard.model_copy(deep=True) if manifest.guard is not None else initial_state(learners)


def check_settings(cfg: Config, values: dict[str, object]) -> Config:
    """The config with live settings applied; ConfigError naming a key that may not change or a bad value."""
    if not values:
        return cfg
    bad = sorted(k for k in values if k not in LIVE_SETTINGS)
    if bad:
        raise ConfigError(f"{', '.join(bad)} cannot change during a run; the live settings are: "
                          f"{', '.join(LIVE_SETTINGS)}")
    return cfg.with_overrides(dict(values))


def entry_of(name: str, op: ControlOp | RecordError) -> ControlEntry:
    """How a merge records an op (an unreadable one as kind 'invalid', refused with the reason)."""
    if isinstance(op, RecordError):
        return ControlEntry(name=name, kind="invalid", t=0.0, by="", refused=str(op)[:300])
    return ControlEntry(name=name, **op.model_dump())


@dataclass
class Policy:
    """What the next merge goes by: the guard state with this merge's ops applied, and the live config."""

    state: GuardState
    entries: list[ControlEntry]
    cfg: Config

    def eligible(self, learner: str) -> bool:
        """Counts toward the quorum and is read at all: a member that is not quarantined."""
        return learner in self.state.members and learner not in self.state.quarantined


def _apply(state: GuardState, entry: ControlEntry, base: Config) -> str:
    """Apply one op to `state` in place; returns why it was refused ("" when applied)."""
    kind, learner = entry.kind, entry.learner
    if kind in ("admit", "remove", "readmit"):
        try:
            validate_learner_name(learner or "")
        except InvalidName as err:
            return str(err)
    if kind == "admit":
        if learner in state.removed:
            return f"learner {learner} was removed from the run; removal is for good"
        state.members = sorted({*state.members, learner})
    elif kind == "remove":
        state.members = [m for m in state.members if m != learner]
        state.removed = sorted({*state.removed, learner})
        state.quarantined.pop(learner, None)
        state.streaks.pop(learner, None)
    elif kind == "readmit":
        state.quarantined.pop(learner, None)
        state.streaks.pop(learner, None)
    elif kind in ("pause-merges", "resume-merges"):
        state.paused = kind == "pause-merges"
    elif kind == "set":
        merged = {**state.settings, **entry.values}
        try:
            check_settings(base, merged)
        except ConfigError as err:
            return str(err)[:300]
        state.settings = merged
    return ""


def policy_after(state: GuardState, entries: list[ControlEntry], base: Config) -> Policy:
    """The state with the ops applied in order (each entry's `refused` filled in), and the live config."""
    state = state.model_copy(deep=True)
    applied: list[ControlEntry] = []
    for entry in entries:
        refused = entry.refused if entry.kind == "invalid" else _apply(state, entry, base)
        applied.append(entry.model_copy(update={"refused": refused}))
        state.ops_cursor = max(state.ops_cursor, entry.name)
    return Policy(state, applied, check_settings(base, state.settings))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def window_median(state: GuardState, cfg: Config) -> float | None:
    """The median norm per step of the window, once it holds outlier_min_samples (else None: no rule yet).
    With whose each sample is (trust rules 2): the median over learners of each learner's median, so no
    learner moves it by sending more deltas, or more extreme ones, than the others."""
    norms = state.norms[-cfg.merger.outlier_window:]
    if len(norms) < cfg.merger.outlier_min_samples:
        return None
    owners = state.norm_learners[-cfg.merger.outlier_window:]
    if len(owners) != len(norms):  # a run made before: samples of nobody
        return _median(norms)
    per_learner: dict[str, list[float]] = {}
    for owner, value in zip(owners, norms, strict=True):
        per_learner.setdefault(owner, []).append(value)
    return _median([_median(values) for values in per_learner.values()])


def fold(state: GuardState, decisions: list[DeltaDecision], version: int, cfg: Config,
         rules: int = 1) -> tuple[GuardState, list[str]]:
    """The state after a merge's decisions: streaks, new quarantines, the window; (state, newly quarantined).
    `rules` (RunContext.trust_rules): 2 = one window sample per learner per merge (its last merged, unclipped
    delta, owner recorded), and the last eligible members are never quarantined: the merges pause instead (an
    operator looks: `diloco readmit`, `resume-merges`); 1 = as runs made before were folded."""
    state = state.model_copy(deep=True)
    newly: list[str] = []
    limit = cfg.merger.quarantine_after
    samples: dict[str, float] = {}  # rules 2: learner -> its sample of this merge (the last one)
    for d in decisions:
        if d.status == "merged" and d.clip_scale is None:
            state.streaks.pop(d.learner, None)
            if d.norm is not None and d.steps > 0:
                if rules >= 2:
                    samples[d.learner] = d.norm / d.steps
                else:
                    state.norms.append(d.norm / d.steps)
            continue
        if not (d.check in INTEGRITY_CHECKS or d.clip_scale is not None):
            continue
        streak = state.streaks.get(d.learner, 0) + 1
        state.streaks[d.learner] = streak
        if limit and streak >= limit and d.learner not in state.quarantined and d.learner in state.members:
            eligible = set(state.members) - set(state.quarantined) - {d.learner}
            # nobody left to merge: stop and let an operator look, never empty
            if rules >= 2 and not eligible:
                state.paused = True
                continue
            state.quarantined[d.learner] = (f"since version {version}: {streak} integrity rejections in a "
                                            f"row, the last: {d.reason[:160]}")
            newly.append(d.learner)
    for learner, value in samples.items():  # in decision order: the merge's learner order
        state.norms.append(value)
        state.norm_learners.append(learner)
    state.norms = state.norms[-cfg.merger.outlier_window:]
    state.norm_learners = state.norm_learners[-cfg.merger.outlier_window:]
    state.streaks = dict(sorted(state.streaks.items()))
    state.quarantined = dict(sorted(state.quarantined.items()))
    return state, newly


def gate(policy: Policy, learner: str, seq: int) -> DeltaDecision | None:
    """The rejection of a delta from a learner that may not publish (never read), or None."""
    state = policy.state
    if learner in state.removed:
        reason, check = f"learner {learner} was removed from the run", "admission"
    elif learner not in state.members:
        reason, check = f"learner {learner} is not admitted to the run (diloco admit-learner)", "admission"
    elif learner in state.quarantined:
        reason = f"quarantined {state.quarantined[learner]} (diloco readmit --learner {learner})"
        check = "quarantine"
    else:
        return None
    return DeltaDecision(learner=learner, seq=seq, status="rejected", reason=reason[:500], check=check)

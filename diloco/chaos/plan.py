"""Fault plans: a YAML file of scripted faults (at a time or a committed version) and random ones.

Contract: `load_plan(path)` returns a validated `Plan` or raises `PlanError` naming the bad field;
unknown keys are refused; `expand(plan, learners, horizon_s)` turns it into a sorted, seeded list.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from diloco.configs import ConfigError
from diloco.storage.keys import InvalidName, validate_learner_name

# a merge's stages, and a checkpoint's (its writer thread: after each part is put, after its JSON landed)
MergeStage = Literal["listing", "writing", "before_manifest", "after_manifest", "checkpoint_part",
                     "checkpoint_written"]
BadVariant = Literal["corrupt", "truncated", "duplicated", "nan", "oversized", "stale"]


class PlanError(ConfigError):
    """A fault plan is unreadable or invalid; the message names the field (a ValueError)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _name(value: str, what: str) -> str:
    try:
        return validate_learner_name(value)
    except InvalidName as err:
        raise ValueError(f"{what}: {err}") from None


class _Fault(_Strict):
    """A scripted fault fires once: `at_s` seconds after the run started, or once `at_version` exists."""

    at_s: float | None = Field(None, ge=0)
    at_version: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_trigger(self) -> _Fault:
        if (self.at_s is None) == (self.at_version is None):
            raise ValueError("give exactly one of at_s or at_version")
        return self


class _LearnerFault(_Fault):
    learner: int | str  # an index into the run's learners, or a learner name

    @field_validator("learner")
    @classmethod
    def _learner(cls, v: int | str) -> int | str:
        if isinstance(v, int):
            if v < 0:
                raise ValueError("a learner index must be >= 0")
            return v
        return _name(v, "learner")


class KillLearner(_LearnerFault):
    kind: Literal["kill_learner"]
    restart_after_s: float = Field(5.0, ge=0)  # the supervisor brings it back after this delay


class KillRank(_LearnerFault):
    kind: Literal["kill_rank"]
    rank: int = Field(1, ge=0)  # SIGKILL this rank of a multi-rank learner: its whole world ends and restarts


class PauseLearner(_LearnerFault):
    kind: Literal["pause_learner"]
    duration_s: float = Field(gt=0)  # SIGSTOP, then SIGCONT after this long: a straggler


class SlowLearner(_LearnerFault):
    kind: Literal["slow_learner"]
    at_s: float | None = Field(0.0, ge=0)  # 0: slow hardware from the start; later: swapped in (restart)
    factor: float = Field(gt=1.0, le=100.0)  # each inner step takes this many times longer


class KillMerger(_Fault):
    kind: Literal["kill_merger"]
    stage: MergeStage  # the merger SIGKILLs itself at this stage of its next merge
    merger_id: str = "merger"

    @field_validator("merger_id")
    @classmethod
    def _merger(cls, v: str) -> str:
        return _name(v, "merger_id")


class SecondMerger(_Fault):
    kind: Literal["second_merger"]
    merger_id: str = "merger-2"  # races the first one for every version from then on

    @field_validator("merger_id")
    @classmethod
    def _merger(cls, v: str) -> str:
        return _name(v, "merger_id")


class StorageOutage(_Strict):
    kind: Literal["storage_outage"]
    at_s: float = Field(ge=0)  # wall-clock windows only: every process must agree on them
    duration_s: float = Field(gt=0)  # every storage operation of every run process fails meanwhile


class StorageDegraded(_Strict):
    kind: Literal["storage_degraded"]
    at_s: float = Field(0.0, ge=0)
    duration_s: float | None = Field(None, gt=0)  # None: until the run ends
    error_rate: float = Field(0.0, ge=0, lt=1)  # fraction of operations that fail (transient)
    latency_s: float = Field(0.0, ge=0, le=60)  # added to every operation
    bandwidth_mbps: float | None = Field(None, gt=0)  # cap on bytes moved per operation


class BadDelta(_Fault):
    kind: Literal["bad_delta"]
    variant: BadVariant
    # a dedicated name, never a live learner's next seq (that would fence it); by default one per variant
    # (chaos-<variant>), so that each shows its own rejection rather than the quarantine that follows a row of
    # them
    learner: str | None = None

    @field_validator("learner")
    @classmethod
    def _learner(cls, v: str | None) -> str | None:
        return None if v is None else _name(v, "learner")

    @property
    def writer(self) -> str:
        return self.learner or f"chaos-{self.variant}"


class SeqBackwards(_Fault):
    kind: Literal["seq_backwards"]
    learner: str = "chaos-1"  # publishes seq 2 first, then seq 1 and 0 after seq 2 was decided

    @field_validator("learner")
    @classmethod
    def _learner(cls, v: str) -> str:
        return _name(v, "learner")


Scripted = Annotated[
    KillLearner | KillRank | PauseLearner | SlowLearner | KillMerger | SecondMerger | StorageOutage
    | StorageDegraded | BadDelta | SeqBackwards,
    Field(discriminator="kind"),
]


class RandomFaults(_Strict):
    """Faults at exponential intervals (mean `mean_interval_s`) per learner, drawn with the plan's seed."""

    kind: Literal["kill_learner", "pause_learner", "kill_merger"]
    mean_interval_s: float = Field(gt=0)
    learners: Literal["all"] | list[int | str] = "all"
    restart_after_s: float = Field(5.0, ge=0)  # kill_learner
    duration_s: float = Field(5.0, gt=0)  # pause_learner
    stages: list[MergeStage] = ["writing", "before_manifest"]  # kill_merger, taken in turn
    start_s: float = Field(0.0, ge=0)  # no random fault before this


class Plan(_Strict):
    name: str = "plan"
    seed: int = 0
    min_duration_s: float | None = Field(None, gt=0)  # the bench runs at least this long
    faults: list[Scripted] = []
    random: list[RandomFaults] = []


@dataclass
class Due:
    """One concrete fault to inject: the scripted fault plus its id and resolved learner."""

    fault_id: str
    fault: BaseModel
    learner: str | None = None

    @property
    def at_s(self) -> float | None:
        return getattr(self.fault, "at_s", None)

    @property
    def at_version(self) -> int | None:
        return getattr(self.fault, "at_version", None)


def _format(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def parse_plan(data: object, source: str = "plan") -> Plan:
    if not isinstance(data, dict):
        raise PlanError(f"fault plan {source}: the top level must be a mapping")
    try:
        return Plan.model_validate(data)
    except ValidationError as err:
        raise PlanError(f"fault plan {source}: {_format(err)}") from None


def load_plan(path: str | Path) -> Plan:
    """Read and validate a YAML fault plan; PlanError names what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise PlanError(f"fault plan {path}: cannot read: {err.strerror or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise PlanError(f"fault plan {path}: not valid YAML: {err}") from None
    return parse_plan(data if data is not None else {}, str(path))


def resolve_learner(ref: int | str, learners: list[str]) -> str:
    if isinstance(ref, int):
        if ref >= len(learners):
            raise PlanError(f"fault plan: learner index {ref} but the run has {len(learners)} learners")
        return learners[ref]
    if ref not in learners:
        raise PlanError(f"fault plan: learner {ref!r} is not a learner of this run ({', '.join(learners)})")
    return ref


def _random_times(rng: random.Random, spec: RandomFaults, horizon_s: float) -> list[float]:
    times, t = [], spec.start_s
    while True:
        t += rng.expovariate(1.0 / spec.mean_interval_s)
        if t >= horizon_s:
            return times
        times.append(t)


def _expand_random(plan: Plan, learners: list[str], horizon_s: float) -> list[Due]:
    rng = random.Random(plan.seed)
    out: list[Due] = []
    for i, spec in enumerate(plan.random):
        if spec.kind == "kill_merger":
            for j, t in enumerate(_random_times(rng, spec, horizon_s)):
                fault = KillMerger(kind="kill_merger", at_s=t, stage=spec.stages[j % len(spec.stages)])
                out.append(Due(f"r{i}-m{j}", fault))
            continue
        targets = (learners if spec.learners == "all"
                   else [resolve_learner(r, learners) for r in spec.learners])
        for name in targets:
            for j, t in enumerate(_random_times(rng, spec, horizon_s)):
                if spec.kind == "kill_learner":
                    fault = KillLearner(kind="kill_learner", at_s=t, learner=name,
                                        restart_after_s=spec.restart_after_s)
                else:
                    fault = PauseLearner(kind="pause_learner", at_s=t, learner=name,
                                         duration_s=spec.duration_s)
                out.append(Due(f"r{i}-{name}-{j}", fault, name))
    return out


def expand(plan: Plan, learners: list[str], horizon_s: float) -> list[Due]:
    """Every fault of the plan, random ones drawn up to horizon_s; learner references resolved."""
    out: list[Due] = []
    for i, fault in enumerate(plan.faults):
        ref = getattr(fault, "learner", None)
        name = resolve_learner(ref, learners) if isinstance(fault, _LearnerFault) else ref
        out.append(Due(f"s{i}", fault, name))
    out.extend(_expand_random(plan, learners, horizon_s))
    return sorted(out, key=lambda d: (d.at_s if d.at_s is not None else float("inf"), d.at_version or 0))

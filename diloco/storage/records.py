"""Typed bucket records: every JSON object of a run other than the manifest — run.json, a learner's
status.json, evals/<version>.json, the control flags (control/stop, control/removed-<learner>) and the
operator's control ops (control/ops/...), the supervisor's lease (control/lease-<epoch>), a merger shard's
heads (global/heads-<shard>.json).

Contract: a record is written with to_bytes() and read with from_bytes(), which raises RecordError
naming the object and what is wrong (never a pydantic error); optional fields left unset are not written.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from diloco.storage.keys import MAX_FRAGMENT, MAX_VERSION
from diloco.storage.store import Store

RUN_SCHEMA_VERSION = 1
KNOWN_RUN_SCHEMA_VERSIONS = (1,)
# How a run stores its chains' state (run.json `storage_format`, docs/STORAGE.md): 1, every version holds its
# full params and outer state (runs made before the log; absent in their run.json); 2, the log: every version
# its update, a checkpoint every `state.checkpoint_every` versions. This code reads both and creates 2.
STORAGE_FORMAT = 2
KNOWN_STORAGE_FORMATS = (1, 2)


class RecordError(ValueError):
    """A stored record is not valid JSON or does not fit its schema; the message names the object."""


class Record(BaseModel):
    """The base of every record: strict fields (unknown ones refused), one JSON encoding."""

    model_config = ConfigDict(extra="forbid")
    what: ClassVar[str] = "record"  # how errors name the object

    def to_bytes(self) -> bytes:
        """JSON; a float NaN is written as NaN (a learner's loss before its first phase)."""
        return json.dumps(self.model_dump(exclude_none=True), indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str = "") -> Self:
        """Parse a stored record; RecordError names the object (and its key, when given)."""
        name = f"{cls.what} {key!r}" if key else cls.what
        try:
            obj = json.loads(data)
        # JSONDecodeError and UnicodeDecodeError are ValueErrors; RecursionError: hostile nesting
        except (ValueError, TypeError, RecursionError) as exc:
            raise RecordError(f"{name} is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise RecordError(f"{name} must be a JSON object, got {type(obj).__name__}")
        cls._check(obj, name)
        try:
            return cls.model_validate(obj)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(record)'}: {e['msg']}"
                                 for e in exc.errors())
            raise RecordError(f"{name} is malformed: {problems}") from None

    @classmethod
    def _check(cls, obj: dict[str, Any], name: str) -> None:
        """A record's own check before validation (schema versions)."""


TRUST_RULES = 4  # the rules a new run's merges judge by (RunRecord.trust_rules; trust/guard.py)
# RunRecord.trust_rules from which a delta's norm sums each tensor's squares a chunk at a time
# (training/fp64.sum_squares_chunked; before: the whole tensor's sum, ~3.4x slower at 124M)
CHUNKED_NORMS_FROM_RULES = 4


class RunRecord(Record):
    """run.json: the resolved config and the model fingerprint every process of the run reads."""

    what: ClassVar[str] = "run record"
    schema_version: int = RUN_SCHEMA_VERSION
    run_id: str
    created_at: float  # unix seconds: tells a new run from an old one of the same id
    created_by: str  # host name
    diloco_version: str
    fingerprint: str
    learners: list[str]
    config: dict[str, Any]  # Config.model_dump(mode="json")
    # the model's layout: [{"name", "shape", "dtype", "direct"}], what the merger and audit work from without
    # the user's code ([] in runs made before TrainSpecs: their fingerprint still guards every object)
    layout: list[dict[str, Any]] = []
    # the model's buffers the run ships and merges (outer.buffers "mean"): [{"name", "shape", "dtype"}]; None
    # (not written) for a model without any, a run that keeps them, and runs made before buffers were merged
    buffers: list[dict[str, Any]] | None = None
    # fragments.count > 1: the fragment layout (diloco.training.fragments.plan_fragments), fixed at creation
    fragments: list[dict[str, Any]] = []
    # tokens in one batch of the spec, as the run was created (None in runs made before): a delta's tokens per
    # step are counted up to TOKENS_SLACK x this in the merge (merger/step.py CounterBounds)
    tokens_per_step: int | None = None
    # the rules the merge judges by (trust/guard.py TRUST_RULES): 2 = the outlier window takes one sample per
    # learner per merge and its median is over learners, the last eligible members are never quarantined; 3 =
    # 2, and the window is kept in the merger's own object, not in the manifests (storage/window.py); 4 = 3,
    # and a delta's norm sums each tensor's squares a chunk at a time (training/fp64.sum_squares_chunked);
    # None (runs made before): 1, as their manifests were folded
    trust_rules: int | None = None
    forked_from: dict[str, Any] | None = None  # `diloco fork`: run_id, storage, version, checksums, by, t
    # STORAGE_FORMAT of the run's chains; None (not written) in runs made before the log: format 1
    storage_format: int | None = None

    @classmethod
    def _check(cls, obj: dict[str, Any], name: str) -> None:
        schema = obj.get("schema_version")
        if schema not in KNOWN_RUN_SCHEMA_VERSIONS:
            raise RecordError(
                f"{name}: schema_version {schema!r} is unknown (this code reads {KNOWN_RUN_SCHEMA_VERSIONS})"
            )
        found = obj.get("storage_format", 1)
        if found not in KNOWN_STORAGE_FORMATS:
            raise RecordError(f"{name}: storage format {found!r} is unknown: this code reads storage formats "
                              f"{', '.join(map(str, KNOWN_STORAGE_FORMATS))} (docs/STORAGE.md); use the "
                              "diloco version that made the run")

    @property
    def format(self) -> int:
        """The run's storage format (1 when run.json predates the field)."""
        return self.storage_format or 1


class LearnerStatus(Record):
    """learners/<learner>/status.json: a learner's heartbeat (the supervisor reads `t` and `pid`)."""

    what: ClassVar[str] = "learner status"
    learner: str
    state: str  # joined, training, waiting; at its end: finished, stopped, removed, failed (FINAL_STATES)
    t: float = Field(allow_inf_nan=False)  # unix seconds of the beat, the learner's clock (read: beat_age)
    pid: int
    seq: int  # the last seq published (-1: none yet)
    base_version: int
    step: int
    cursor: int  # data cursor
    loss: float  # the last phase's mean training loss; NaN before the first phase
    bytes_published: int
    ranks: int = 1  # processes of the learner's world
    rank_pids: list[int] | None = None  # their process ids, rank 0 first (multi-rank learners)
    tokens_per_phase: int | None = None  # the figures of the phase just ended, after a phase
    stall_s: float | None = None
    steps_per_s: float | None = None
    # inner steps per second of compute, averaged over the last phases (inner.dylu: peers read it to set their
    # H)
    compute_steps_per_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    # own deltas shipped and not yet decided by the version(s) it holds (summed over a fragmented learner's
    # chains; learner.max_unmerged bounds each chain's count; None: not known, e.g. after a resume from local
    # state until an install)
    unmerged: int | None = Field(None, ge=0)
    # state "failed" (diloco.run.failure): the error's last line, whether a restart cannot fix it (the user's
    # code or config at the learner's start), where its log is, and whether the supervisor left it down for
    # good
    error: str | None = None
    fatal: bool | None = None
    log: str | None = None
    given_up: bool | None = None


# a learner's state once its loop (or process) ended
FINAL_STATES = ("finished", "stopped", "removed", "failed")
# how far ahead of the reader's clock a heartbeat may be and still count: the skew of two honest clocks (NTP
# keeps them within a second); further ahead it is from the future
CLOCK_SKEW_S = 60.0


def beat_age(t: float, now: float) -> float | None:
    """Seconds since a heartbeat stamped `t`, by the reader's clock `now` — what every reader that decides on
    a heartbeat goes by (the supervisor's silence check, resume's "is the run live", `diloco status`). A beat
    at most CLOCK_SKEW_S ahead counts as just now (0); one further ahead is None: from the future, ignored —
    never a sign of life (a status forged with a far-ahead `t`, or a host clock far off, would otherwise look
    live for days)."""
    if not math.isfinite(t) or t - now > CLOCK_SKEW_S:
        return None
    return max(0.0, now - t)


class SupervisorLease(Record):
    """control/lease-<epoch>: one supervisor session of the run, renewed while it lives.

    The supervisor creates the next epoch exclusively (a second supervisor of a live run is refused) and
    rewrites it every few seconds (`beat` + 1); roles stop when `beat` has not moved for `timeout_s` on
    their own clock (the supervisor is gone) or past `deadline` (the time limit holds without it)."""

    what: ClassVar[str] = "supervisor lease"
    epoch: int = Field(ge=1)
    owner: str  # a random id of this session
    host: str
    pid: int
    kind: str  # "local", "prefect" or "deployments": what supervises
    started_at: float  # unix seconds, the supervisor's clock
    t: float  # the last renewal, the supervisor's clock
    beat: int = 0  # renewals so far
    # no renewal for this long: the supervisor is gone (run.heartbeat_timeout_s)
    timeout_s: float = Field(gt=0)
    deadline: float  # started_at + run.time_limit_s
    released: bool = False  # the session ended (end_reason says why)
    end_reason: str | None = None


class EvalRecord(Record):
    """evals/<version>.json: the held-out loss of one committed version."""

    what: ClassVar[str] = "eval record"
    version: int = Field(ge=0)
    loss: float  # the spec's held-out metric (the built-in GPT's: nats per byte)
    metric: str = "nats/byte"  # its name (records written before specs: the GPT's)
    bits_per_byte: float | None = None  # loss / ln 2 when the metric is nats/byte
    tokens_total: int = 0  # tokens merged up to this version
    t: float = 0.0  # unix seconds of the evaluation
    committed_at: float = 0.0  # the version's manifest created_at


class StopRequest(Record):
    """control/stop: every role of the run ends when it sees this."""

    what: ClassVar[str] = "stop request"
    reason: str
    t: float


class RemovedMark(Record):
    """control/removed-<learner>: an operator removed the learner for good."""

    what: ClassVar[str] = "removal mark"
    reason: str
    t: float


class CheckpointPart(BaseModel):
    """One part of a chain checkpoint: an fp32 tensor object holding flat slices of the state's tensors."""

    model_config = ConfigDict(extra="forbid")
    key: str
    checksum: str  # BLAKE2b of the part's bytes
    bytes: int = Field(ge=0)
    slices: list[tuple[str, int, int]]  # (state tensor, first element, one past the last) of each slice


class CheckpointRecord(Record):
    """<chain>/checkpoints/<version>-<nonce>/checkpoint.json: one chain's params and outer state at one
    version, in parts of bounded size (written first), listed here with their checksums (this object last:
    a checkpoint exists once it does)."""

    what: ClassVar[str] = "checkpoint"
    schema_version: int = 1
    run_id: str
    fragment: int | None = None  # the chain (None: the root)
    version: int = Field(ge=0)
    created_at: float
    created_by: str  # the merger (or `create`, `fork`) that wrote it
    fingerprint: str
    # BLAKE2b of the version's manifest bytes (the version it is the state of); "" when the checkpoint is
    # written before its manifest (version 0 of a created or forked run, which names it)
    manifest_checksum: str = ""
    tensors: list[tuple[str, list[int]]]  # (name, shape) of every state tensor: params/<p>, momentum/<p>, ...
    parts: list[CheckpointPart]
    outer: bool  # whether it holds outer state (momentum/, residual/, pending/); False: zeros (version 0)
    pending_share: float = 0.0  # experimental.momentum_per delayed: the round share of `pending`
    ema: dict[str, float] = {}  # the grace window's moving averages at this version

    @classmethod
    def _check(cls, obj: dict[str, Any], name: str) -> None:
        if obj.get("schema_version") != 1:
            raise RecordError(f"{name}: schema_version {obj.get('schema_version')!r} is unknown (this code "
                              "reads 1)")


class RetentionRecord(Record):
    """<chain>/retention.json: what `diloco gc --keep-versions/--before` removed; the chain's history is kept
    from `oldest` on (the checkpoint there, every update and merged delta after it), and audit replays from
    it."""

    what: ClassVar[str] = "retention record"
    oldest: int = Field(ge=0)  # the oldest version whose state can still be rebuilt: a checkpoint's
    checkpoint_key: str
    checkpoint_checksum: str
    t: float
    by: str
    removed_objects: int = 0  # by every gc so far
    removed_bytes: int = 0


class HeadsRecord(Record):
    """global/heads-<shard>.json: the newest version of each chain a merger shard holds, rewritten after each
    of its commits (diloco.storage.heads: a hint for the learners' one poll, never the truth)."""

    what: ClassVar[str] = "heads"
    format: Literal[1] = 1
    merger: str
    versions: dict[Annotated[int, Field(ge=0, le=MAX_FRAGMENT)],  # chain index -> its newest version
                   Annotated[StrictInt, Field(ge=0, le=MAX_VERSION)]]


OP_KINDS = ("admit", "remove", "readmit", "pause-merges", "resume-merges", "set", "resume", "fork")


class ControlOp(Record):
    """control/ops/<time>-<nonce>.json: one operator action, written once by exclusive create; the merger
    applies it at its next merge and records it in that manifest (what, the values, when, who)."""

    what: ClassVar[str] = "control op"
    kind: Literal["admit", "remove", "readmit", "pause-merges", "resume-merges", "set", "resume", "fork"]
    t: float  # unix seconds
    by: str  # user@host, or the Prefect flow run
    learner: str | None = None  # admit, remove, readmit
    values: dict[str, Any] = {}  # set: dotted key -> value; resume: the new target; fork: the parent
    reason: str = ""

    @field_validator("values")
    @classmethod
    def _finite(cls, values: dict[str, Any]) -> dict[str, Any]:
        """No inf or nan anywhere: JSON cannot carry them exactly (an op's values are recorded in a manifest
        and replayed by audit), and a merger must never act on one."""
        bad = next((k for k, v in values.items() if not finite_json(v)), None)
        if bad is not None:
            raise ValueError(f"{bad}: {values[bad]!r} is not a finite value (no inf or nan)")
        return values


def finite_json(value: Any) -> bool:
    """Whether JSON carries `value` exactly: no float inf or nan in it, at any depth."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_json(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(finite_json(v) for v in value)
    return True


R = TypeVar("R", bound=Record)


def read_record(store: Store, key: str, cls: type[R]) -> R:
    """The record at key. NotFound if absent; RecordError if it does not parse as `cls`."""
    return cls.from_bytes(store.get(key), key=key)


def write_record(store: Store, key: str, record: Record, *, exclusive: bool = False) -> None:
    """Store a record; exclusive=True means put_if_absent (Conflict if the key exists)."""
    data = record.to_bytes()
    if exclusive:
        store.put_if_absent(key, data)
    else:
        store.put(key, data)

"""Manifests and the commit protocol: a version exists iff its manifest was exclusively created.

Contract: objects a manifest references are written first under a fresh nonce; the manifest is
written last with put_if_absent; the loser of a race gets Conflict and must reload.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco.storage.errors import Conflict
from diloco.storage.keys import RunKeys, parse_manifest_key
from diloco.storage.store import Store

# 1: every version names its params (and outer state) objects; 2: the log (docs/STORAGE.md) — a version names
# its update and the newest checkpoint at or before it (`checkpoint`); params/outer keys only in manifests
# written before
SCHEMA_VERSION = 2
KNOWN_SCHEMA_VERSIONS = (1, 2)


# the outlier rule's statistics of a merge (Manifest.stats): with the window's object when the run keeps one
WINDOW_STATS = ("outlier_median", "outlier_bound")
# a decision's figures that tell the bound (its norm, a clip's scale, the outlier rule's numbers): with the
# window's object too, when the run keeps one (storage/window.py)
PRIVATE_DECISION = ("norm", "clip_scale", "detail")


class ManifestError(ValueError):
    """A manifest is malformed or has an unknown schema_version (the other records: storage.records)."""


class DeltaDecision(BaseModel):
    """What one merge decided about one delta."""

    model_config = ConfigDict(extra="forbid")
    learner: str
    seq: int
    status: Literal["merged", "rejected", "lost"]
    reason: str = ""  # why it was rejected or declared lost; empty when merged
    base_version: int = -1
    staleness: int = 0
    tokens: int = 0
    steps: int = 0
    weight: float = 0.0  # normalised weight in the combine (sums to 1 over merged deltas)
    bytes: int = 0
    checksum: str = ""
    # which check decided a rejection: admission, quarantine, signature, codec, invalid, stale, outlier, error
    # (judging raised: not counted against the learner) ("" when merged or lost; old manifests have none);
    # norm: the delta's L2 norm (fp64 over the decoded tensors)
    check: str = ""
    norm: float | None = None
    clip_scale: float | None = None  # outlier_rule clip: the factor the delta was scaled by
    # trust rules 3: the outlier rule's figures behind an outlier decision (its norm per step, the median, the
    # bound), kept with the window while `reason` says what happened without them; "" otherwise (written only
    # when set)
    detail: str = ""
    # a range: seqs seq..seq_last decided by one decision, however long (never one decision per seq): a gap
    # declared lost, or every key of a name never admitted (rejected for admission)
    seq_last: int | None = None

    @property
    def last_seq(self) -> int:
        """The highest seq this decision decides (seq_last of a lost range, else seq)."""
        return self.seq if self.seq_last is None else self.seq_last


class ControlEntry(BaseModel):
    """An operator control op as the merge that applied it recorded it (storage.records.ControlOp + its
    name)."""

    model_config = ConfigDict(extra="forbid")
    name: str  # control/ops/<name>.json
    kind: str
    t: float
    by: str
    learner: str | None = None
    values: dict[str, Any] = {}
    reason: str = ""
    refused: str = ""  # why the merger did not apply it (e.g. a key that may not change live)


class WindowRef(BaseModel):
    """Where the outlier window after a version is kept (storage.window): the merger's own object, its
    checksum."""

    model_config = ConfigDict(extra="forbid")
    key: str
    checksum: str


class GuardState(BaseModel):
    """Who may publish and how the merge judges deltas, after this version (trust/guard.py folds it).

    A manifest without one (older runs, version 0) means: the run.json learners, nothing else."""

    model_config = ConfigDict(extra="forbid")
    members: list[str] = []  # admitted and not removed, sorted
    removed: list[str] = []
    quarantined: dict[str, str] = {}  # learner -> why, since which version
    streaks: dict[str, int] = {}  # learner -> integrity rejections in a row
    norms: list[float] = []  # norm per step of the last merged (unclipped) deltas, oldest first
    # whose each sample is (trust rules 2: one per learner per merge); [] in runs made before: samples of
    # nobody
    norm_learners: list[str] = []
    settings: dict[str, Any] = {}  # live settings in force (`diloco set`): dotted key -> value
    paused: bool = False
    ops_cursor: str = ""  # the name of the last control op applied
    # runs of trust rules 3 (storage.window): the object that holds `norms`, `norm_learners` and the outlier
    # statistics, which the stored manifest then leaves out (learners read manifests: the bound stays
    # unpublished); None: they are inline, as in runs made before; written only when set
    window: WindowRef | None = None


class CheckpointRef(BaseModel):
    """A chain checkpoint a manifest names: its version (at or before the manifest's), its JSON object and
    that object's checksum (the JSON lists the parts and theirs)."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)
    key: str
    checksum: str


class Manifest(BaseModel):
    """The commit record of one global version."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION
    run_id: str
    version: int = Field(ge=0)
    parent: int = -1  # version - 1, or -1 for version 0
    created_at: float  # unix seconds
    merger_id: str = ""
    # schema 1 (every version, kept readable) and version 0 of runs made before the log: the version's full
    # params and (version >= 1) outer state objects; "" in the log's manifests, which name `checkpoint`
    # instead
    params_key: str = ""
    params_checksum: str = ""
    # the newest complete checkpoint of the chain at or before this version, when the manifest was committed
    # (version 0's is itself): G_v = its params + the updates after it (docs/STORAGE.md, invariant 3)
    checkpoint: CheckpointRef | None = None
    update_key: str = ""  # empty for version 0
    update_checksum: str = ""
    outer_key: str = ""
    outer_checksum: str = ""
    # the model's buffers at this version (a run that merges buffers; a fragmented run's fragment 0): written
    # only when set, so a manifest of a run without buffers is what it was before they existed
    buffers_key: str = ""
    buffers_checksum: str = ""
    # version 0 of a run's root chain: the BLAKE2b of run.json's bytes as created (diloco.run.pin), checked by
    # every open and by audit; written only when set (runs created before it, other versions)
    run_json_checksum: str = ""
    decisions: list[DeltaDecision] = []
    cursors: dict[str, int] = {}  # learner -> highest decided seq (merged, rejected or lost)
    tokens_total: int = 0  # tokens merged up to and including this version (as counted: merger/step.py)
    timing: dict[str, float] = {}  # quorum_wait_s, grace_s, merge_s, ...
    stats: dict[str, float] = {}  # update_norm, outlier_median, ...
    guard: GuardState | None = None
    controls: list[ControlEntry] = []  # operator control ops applied by this merge
    # the grace window's moving averages after this merge (phase_s, quorum_s, merge_s): a merger restarted on
    # this version takes them from here (before the log: from the outer state object's header)
    ema: dict[str, float] = {}

    def merged(self) -> list[DeltaDecision]:
        return [d for d in self.decisions if d.status == "merged"]

    def rejected(self) -> list[DeltaDecision]:
        return [d for d in self.decisions if d.status != "merged"]

    def to_bytes(self) -> bytes:
        fields = self.model_dump(mode="json")
        for name in ("buffers_key", "buffers_checksum", "run_json_checksum", "checkpoint", "ema",
                     "params_key", "params_checksum"):
            if not fields[name] and not (name.startswith("params") and fields["schema_version"] == 1):
                del fields[name]
        guard = fields["guard"]
        if guard is not None and guard["window"] is None:
            del guard["window"]  # a manifest of a run that publishes its window: the bytes as before
        elif guard is not None:  # kept in the window's object: never in what learners read
            del guard["norms"], guard["norm_learners"]
            for name in WINDOW_STATS:
                fields["stats"].pop(name, None)
            for decision in fields["decisions"]:
                for name in PRIVATE_DECISION:
                    del decision[name]
        # only a lost range has one, only a kept-apart outlier decision a detail: the bytes of every other
        # are as before
        for decision in fields["decisions"]:
            if decision["seq_last"] is None:
                del decision["seq_last"]
            if not decision.get("detail", True):
                del decision["detail"]
        return json.dumps(fields, sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse a stored manifest; ManifestError names what is wrong (never a pydantic error)."""
        obj = _loads(data, "manifest")
        if not isinstance(obj, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(obj).__name__}")
        schema = obj.get("schema_version")
        if schema not in KNOWN_SCHEMA_VERSIONS:
            raise ManifestError(
                f"manifest schema_version {schema!r} is unknown (this code reads {KNOWN_SCHEMA_VERSIONS})"
            )
        try:
            manifest = cls.model_validate(obj)
        except ValidationError as exc:
            raise ManifestError(f"manifest is malformed: {exc}") from exc
        if not manifest.params_key and manifest.checkpoint is None:
            raise ManifestError(f"manifest of version {manifest.version} names neither its params nor a "
                                "checkpoint")
        if manifest.version >= 1 and not manifest.params_key and not manifest.update_key:
            raise ManifestError(f"manifest of version {manifest.version} names no update (the log's entry "
                                "every reader installs) and no params")
        return manifest

    @property
    def state_version(self) -> int:
        """The version of the state a reader starts from: this version's own (a manifest that names its
        params: schema 1, version 0 of a run made before the log), or its checkpoint's."""
        if self.params_key:
            return self.version
        return self.checkpoint.version if self.checkpoint is not None else 0


def _loads(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError(f"{what} is not valid JSON: {exc}") from exc


def commit(store: Store, keys: RunKeys, manifest: Manifest) -> None:
    """Commit a version: exclusive create of its manifest. Conflict if another writer got there first.

    Everything the manifest references must already be written. On Conflict, reload the latest
    version and start over; never retry the same version with different content.
    """
    if manifest.run_id != keys.run_id:
        raise ManifestError(f"manifest run_id {manifest.run_id!r} does not match run {keys.run_id!r}")
    key = keys.manifest(manifest.version)
    try:
        store.put_if_absent(key, manifest.to_bytes())
    except Conflict as exc:
        raise Conflict(f"version {manifest.version} of run {keys.run_id!r} is already committed") from exc


def read_manifest(store: Store, keys: RunKeys, version: int) -> Manifest:
    """The committed manifest of a version. NotFound if not committed; ManifestError if malformed."""
    manifest = Manifest.from_bytes(store.get(keys.manifest(version)))
    if manifest.version != version or manifest.run_id != keys.run_id:
        raise ManifestError(
            f"manifest at {keys.manifest(version)!r} says run {manifest.run_id!r} version "
            f"{manifest.version}, expected run {keys.run_id!r} version {version}"
        )
    return manifest


def list_versions(store: Store, keys: RunKeys, after: int | None = None) -> list[int]:
    """Every committed version, sorted, from one fresh listing (never cached); other keys are ignored.
    `after`: only the versions above it (S3's StartAfter from its key: O(versions after it), not O(run))."""
    start = keys.manifest(after) if after is not None and after >= 0 else ""
    versions = (parse_manifest_key(key) for key in store.list(keys.versions_prefix(), start))
    return sorted(v for v in versions if v is not None and (after is None or v > after))


def chain_top(versions: list[int], below: int) -> int:
    """The last of the consecutive versions below+1, below+2, ... in `versions` (sorted); `below` when the
    next is missing. A manifest above a gap is no version of the chain: one merger commits v+1 on v, never
    further."""
    top = below
    for v in versions:
        if v != top + 1:
            break
        top = v
    return top


def latest_version(store: Store, keys: RunKeys, after: int | None = None) -> int | None:
    """The newest version of the chain, or None before version 0: the top of the consecutive versions from 0,
    or from `after` (a version the caller knows is committed: the listing starts there, so a poller's cost
    follows what is new, not the run's age). A stray manifest key above a gap (`versions/<99999>.json`) is not
    it."""
    known = -1 if after is None else after
    top = chain_top(list_versions(store, keys, after), known)
    return None if top < 0 else top


MAX_STEP_DOWN = 8  # unreadable newest manifests a reader steps over before it gives up (ManifestError)


def read_latest(store: Store, keys: RunKeys, after: int | None = None) -> Manifest | None:
    """The manifest of the newest version (latest_version), or None if nothing is committed yet. A newest
    manifest that does not parse, names another run or version, or does not chain to the version below it is
    stepped over (chain_problems names it), at most MAX_STEP_DOWN; a reader never ends, installs or resumes on
    one."""
    top = latest_version(store, keys, after)
    for version in range(top if top is not None else -1, max(-1, (top or 0) - MAX_STEP_DOWN - 1), -1):
        try:
            manifest = read_manifest(store, keys, version)
        except ManifestError:
            continue
        if manifest.parent == version - 1:
            return manifest
    if top is None:
        return None
    raise ManifestError(f"run {keys.run_id!r}: none of the newest {MAX_STEP_DOWN + 1} manifests up to "
                        f"version {top} is readable and chained (`diloco audit` names them)")


def chain_problems(store: Store, keys: RunKeys) -> list[str]:
    """One line per manifest key that is no version of the chain: above a gap in the versions, or at the top
    of the chain but unreadable or not chained to the version below (what read_latest steps over). One
    listing."""
    versions = list_versions(store, keys)
    top = chain_top(versions, -1)
    problems = [f"{keys.manifest(v)}: above a gap (the chain ends at version {top}); ignored"
                for v in versions if v > top]
    for version in range(top, max(-1, top - MAX_STEP_DOWN - 1), -1):
        try:
            manifest = read_manifest(store, keys, version)
        except ManifestError as err:
            problems.append(f"{keys.manifest(version)}: unreadable ({str(err)[:200]}); stepped over")
            continue
        if manifest.parent != version - 1:
            problems.append(f"{keys.manifest(version)}: its parent is {manifest.parent}, not {version - 1}; "
                            "stepped over")
            continue
        break
    return problems


def manifest_exists(store: Store, keys: RunKeys, version: int) -> bool:
    """The cheap probe a learner uses for 'is version v committed yet?' (one HEAD request)."""
    return store.exists(keys.manifest(version))


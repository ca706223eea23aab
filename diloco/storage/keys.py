"""Every object key of a run is built here, and nowhere else (DESIGN §3).

Contract: names are validated before they become keys; no input can escape the run's prefix.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

# `[a-z]` and `[0-9]` are ASCII-only here (no re.UNICODE digits); fullmatch rejects a trailing '\n'.
_LEARNER_RE = re.compile(r"[a-z0-9-]{1,48}")
_RUN_ID_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_NONCE_RE = re.compile(r"[0-9a-f]{8,32}")
_NAME_RE = re.compile(r"[a-z0-9_-][a-z0-9._-]{0,63}")  # checkpoint / event / control names
_MANIFEST_RE = re.compile(r"(?:.*/)?versions/([0-9]{20})\.json")
_LEASE_RE = re.compile(r"(?:.*/)?control/lease-([0-9]{12})")
_DELTA_RE = re.compile(r"(?:.*/)?deltas/([a-z0-9-]{1,48})/([0-9]{12})\.delta")
_HEADS_RE = re.compile(r"(?:.*/)?global/heads-([0-9]{4})\.json")
_OP_RE = re.compile(r"[0-9]{20}-[0-9a-f]{8}")  # a control operation: <time ns:020d>-<nonce>
_OP_KEY_RE = re.compile(r"(?:.*/)?control/ops/([0-9]{20}-[0-9a-f]{8})\.json")
# a chain's checkpoint: its folder <version:020d>-<nonce>/ under checkpoints/, the small JSON that lists its
# parts
_CHECKPOINT_RE = re.compile(
    r"(?:.*/)?checkpoints/([0-9]{20})-([0-9a-f]{8,32})/(checkpoint\.json|part-[0-9]{5})")

MAX_VERSION = 10**20 - 1  # the widest number that keeps `{version:020d}` sorting lexically
MAX_SEQ = 10**12 - 1  # likewise for `{seq:012d}`
MAX_FRAGMENT = 9999  # likewise for `fragments/{p:04d}`
MAX_PART = 99_999  # likewise for a checkpoint's `part-{i:05d}`


class InvalidName(ValueError):
    """A learner name, run id, version, seq or nonce is invalid; the message names it."""


def _check(pattern: re.Pattern[str], value: object, what: str, rule: str) -> str:
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise InvalidName(f"{what} {value!r} is invalid: must match {rule}")
    return value


def validate_learner_name(name: str) -> str:
    """`[a-z0-9-]{1,48}` or InvalidName naming the bad value."""
    return _check(_LEARNER_RE, name, "learner name", "[a-z0-9-]{1,48}")


# the event sources (events/<source>/) and ids of the roles: a learner of one of these names would write where
# the role writes (its events, the merger's `events/merger*` grant) and pass for it in the run's timeline and
# goodput
ROLE_NAMES = ("merger", "evaluator", "operator", "supervisor", "chaos")


def validate_new_learner_name(name: str) -> str:
    """A name for a learner joining a run (created, admitted, given a bucket policy): `[a-z0-9-]{1,48}` and
    not a role's name (ROLE_NAMES, or `merger-*`: the merger's shards) — or InvalidName naming the rule."""
    validate_learner_name(name)
    if name in ROLE_NAMES or name.startswith("merger-"):
        raise InvalidName(f"learner name {name!r} is reserved: the roles' names ({', '.join(ROLE_NAMES)}, "
                          "merger-*) name their events and grants; choose another")
    return name


def validate_run_id(run_id: str) -> str:
    """`[a-z0-9][a-z0-9._-]{0,63}`, and not '.' / '..' — or InvalidName."""
    _check(_RUN_ID_RE, run_id, "run id", "[a-z0-9][a-z0-9._-]{0,63}")
    if ".." in run_id:
        raise InvalidName(f"run id {run_id!r} is invalid: must not contain '..'")
    return run_id


def validate_name(name: str, what: str = "name") -> str:
    """A checkpoint, event-source or control name: `[a-z0-9._-]{1,64}`, not starting with '.'."""
    return _check(_NAME_RE, name, what, "[a-z0-9._-]{1,64} and not starting with '.'")


def validate_nonce(nonce: str) -> str:
    """`[0-9a-f]{8,32}` or InvalidName."""
    return _check(_NONCE_RE, nonce, "nonce", "[0-9a-f]{8,32}")


def _check_int(value: object, what: str, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise InvalidName(f"{what} {value!r} is invalid: must be an int in [0, {maximum}]")
    return value


@dataclass(frozen=True)
class RunKeys:
    """The keys of one run, all under `<run_id>/`."""

    run_id: str
    # a fragment's own namespace `<run>/fragments/<p:04d>/` for its versions, globals and deltas (None: the
    # run's root, the whole model); everything else (run.json, control, learners, evals, events) stays at the
    # root
    fragment: int | None = None

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        if self.fragment is not None:
            _check_int(self.fragment, "fragment", MAX_FRAGMENT)

    @property
    def chain_root(self) -> str:
        """Where this chain's versions/, global/ and deltas/ live."""
        return self.run_id if self.fragment is None else f"{self.run_id}/fragments/{self.fragment:04d}"

    def for_fragment(self, fragment: int | None) -> RunKeys:
        """The keys of fragment `fragment`'s chain (None: the root chain)."""
        return RunKeys(self.run_id, fragment)

    def fragments_prefix(self) -> str:
        return f"{self.run_id}/fragments/"

    def _version(self, version: int) -> str:
        return f"{_check_int(version, 'version', MAX_VERSION):020d}"

    def _global(self, version: int, nonce: str, suffix: str) -> str:
        return f"{self.chain_root}/global/{self._version(version)}-{validate_nonce(nonce)}.{suffix}"

    def run_json(self) -> str:
        return f"{self.run_id}/run.json"

    def versions_prefix(self) -> str:
        return f"{self.chain_root}/versions/"

    def manifest(self, version: int) -> str:
        return f"{self.versions_prefix()}{self._version(version)}.json"

    def global_prefix(self) -> str:
        return f"{self.chain_root}/global/"

    def heads(self, shard: int) -> str:
        """Merger shard `shard`'s heads (diloco.storage.heads): in the run's root global/, any chain's."""
        return f"{self.run_id}/global/heads-{_check_int(shard, 'shard', MAX_FRAGMENT):04d}.json"

    def params(self, version: int, nonce: str) -> str:
        return self._global(version, nonce, "params")

    def update(self, version: int, nonce: str) -> str:
        return self._global(version, nonce, "update")

    def outer(self, version: int, nonce: str) -> str:
        return self._global(version, nonce, "outer")

    def buffers(self, version: int, nonce: str) -> str:
        """The model's merged buffers at a version (runs that merge buffers: run.json's `buffers`)."""
        return self._global(version, nonce, "buffers")

    def checkpoints_prefix(self) -> str:
        """The chain's checkpoints (params + outer state every `state.checkpoint_every` versions)."""
        return f"{self.chain_root}/checkpoints/"

    def checkpoint_folder(self, version: int, nonce: str) -> str:
        return f"{self.checkpoints_prefix()}{self._version(version)}-{validate_nonce(nonce)}/"

    def chain_checkpoint(self, version: int, nonce: str) -> str:
        """The checkpoint's own small JSON (its parts, their checksums, the slices each holds): written last,
        so a checkpoint exists once it does."""
        return f"{self.checkpoint_folder(version, nonce)}checkpoint.json"

    def checkpoint_part(self, version: int, nonce: str, index: int) -> str:
        return f"{self.checkpoint_folder(version, nonce)}part-{_check_int(index, 'part', MAX_PART):05d}"

    def guard_prefix(self) -> str:
        """The merger's own objects of the chain's guard: read by the merger, the operator and audit, never
        by a learner or the evaluator (bucket policy)."""
        return f"{self.chain_root}/guard/"

    def guard_window(self, version: int, nonce: str) -> str:
        """The outlier window after a version (norms, their learners, the median): kept out of the manifest
        learners read (docs/TRUST.md, issue #44 invariant 6); written once, before the version's manifest."""
        return f"{self.guard_prefix()}{self._version(version)}-{validate_nonce(nonce)}.json"

    def retention(self) -> str:
        """What `diloco gc --keep-versions/--before` removed from the chain, and where its kept history
        starts."""
        return f"{self.chain_root}/retention.json"

    def deltas_prefix(self, learner: str | None = None) -> str:
        if learner is None:
            return f"{self.chain_root}/deltas/"
        return f"{self.chain_root}/deltas/{validate_learner_name(learner)}/"

    def delta(self, learner: str, seq: int) -> str:
        learner = validate_learner_name(learner)  # None would mean "all learners" to deltas_prefix
        return f"{self.deltas_prefix(learner)}{_check_int(seq, 'seq', MAX_SEQ):012d}.delta"

    def learners_prefix(self) -> str:
        return f"{self.run_id}/learners/"

    def learner_prefix(self, learner: str) -> str:
        return f"{self.learners_prefix()}{validate_learner_name(learner)}/"

    def status(self, learner: str) -> str:
        return f"{self.learner_prefix(learner)}status.json"

    def checkpoint(self, learner: str, name: str) -> str:
        return f"{self.learner_prefix(learner)}checkpoint/{validate_name(name, 'checkpoint name')}"

    def eval(self, version: int) -> str:
        return f"{self.evals_prefix()}{self._version(version)}.json"

    def evals_prefix(self) -> str:
        return f"{self.run_id}/evals/"

    def event(self, source: str, name: str) -> str:
        source = validate_name(source, "event source")
        return f"{self.events_prefix()}{source}/{validate_name(name, 'event name')}.jsonl"

    def events_prefix(self) -> str:
        return f"{self.run_id}/events/"

    def spec_file(self, name: str) -> str:
        """A file the run's spec keeps in the bucket (a trained tokenizer, ...), under <run>/spec/."""
        return f"{self.run_id}/spec/{validate_name(name, 'spec file name')}"

    def stop(self) -> str:
        return self.control("stop")

    def removed(self, learner: str) -> str:
        """The mark of a learner an operator removed for good."""
        return self.control(f"removed-{validate_learner_name(learner)}")

    def control(self, name: str) -> str:
        return f"{self.run_id}/control/{validate_name(name, 'control name')}"

    def signature(self, learner: str, seq: int) -> str:
        """The HMAC of a signed delta, beside it (written before the delta; never listed as a delta)."""
        return self.delta(learner, seq).removesuffix(".delta") + ".sig"

    def ops_prefix(self) -> str:
        """Operator controls, one object each, named so that they sort in the order they were made."""
        return f"{self.run_id}/control/ops/"

    def op(self, name: str) -> str:
        return f"{self.ops_prefix()}{_check(_OP_RE, name, 'control op name', '<20 digits>-<8 hex>')}.json"

    def lease(self, epoch: int) -> str:
        """The lease of one supervisor session (epoch 1, 2, …; the highest is the current one)."""
        return self.control(f"lease-{_check_int(epoch, 'lease epoch', MAX_SEQ):012d}")

    def leases_prefix(self) -> str:
        return f"{self.run_id}/control/lease-"


def parse_manifest_key(key: str) -> int | None:
    """The version of a manifest key, or None if the key is not a manifest."""
    match = _MANIFEST_RE.fullmatch(key) if isinstance(key, str) else None
    return int(match.group(1)) if match else None


def parse_checkpoint_key(key: str) -> tuple[int, str, str] | None:
    """(version, nonce, name) of a key inside a chain checkpoint's folder (name: `checkpoint.json` or
    `part-<i>`), or None if the key is not one."""
    match = _CHECKPOINT_RE.fullmatch(key) if isinstance(key, str) else None
    return (int(match.group(1)), match.group(2), match.group(3)) if match else None


def parse_lease_key(key: str) -> int | None:
    """The epoch of a supervisor lease key, or None if the key is not one."""
    match = _LEASE_RE.fullmatch(key) if isinstance(key, str) else None
    return int(match.group(1)) if match else None


def parse_delta_key(key: str) -> tuple[str, int] | None:
    """(learner, seq) of a delta key, or None if the key is not a well-formed delta key."""
    match = _DELTA_RE.fullmatch(key) if isinstance(key, str) else None
    return (match.group(1), int(match.group(2))) if match else None


def parse_heads_key(key: str) -> int | None:
    """The shard of a heads key (RunKeys.heads), else None."""
    m = _HEADS_RE.fullmatch(key)
    return int(m.group(1)) if m else None


def parse_op_key(key: str) -> str | None:
    """The name of a control-op key (`<time ns:020d>-<nonce>`), or None if the key is not one."""
    match = _OP_KEY_RE.fullmatch(key) if isinstance(key, str) else None
    return match.group(1) if match else None


def new_nonce() -> str:
    """A fresh random nonce (16 hex chars) for objects written before a manifest."""
    return secrets.token_hex(8)

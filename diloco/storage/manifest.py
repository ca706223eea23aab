"""Manifests and the commit protocol: a version exists iff its manifest was exclusively created.

Contract: objects a manifest references are written first under a fresh nonce; the manifest is
written last with put_if_absent; the loser of a race gets Conflict and must reload.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1


class ManifestError(ValueError):
    """A manifest object is malformed or has an unknown schema_version."""


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


class Manifest(BaseModel):
    """The commit record of one global version."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION
    run_id: str
    version: int = Field(ge=0)
    parent: int = -1  # version - 1, or -1 for version 0
    created_at: float  # unix seconds
    merger_id: str = ""
    params_key: str
    params_checksum: str
    update_key: str = ""  # empty for version 0
    update_checksum: str = ""
    outer_key: str = ""
    outer_checksum: str = ""
    decisions: list[DeltaDecision] = []
    cursors: dict[str, int] = {}  # learner -> highest decided seq (merged, rejected or lost)
    tokens_total: int = 0  # tokens merged up to and including this version
    timing: dict[str, float] = {}  # quorum_wait_s, grace_s, merge_s, ...
    stats: dict[str, float] = {}  # update_norm, ...

    def merged(self) -> list[DeltaDecision]:
        return [d for d in self.decisions if d.status == "merged"]

    def rejected(self) -> list[DeltaDecision]:
        return [d for d in self.decisions if d.status != "merged"]

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        raise NotImplementedError  # STUB: parse, check schema_version, raise ManifestError


# STUB functions — to be implemented:
# def commit(store, keys: RunKeys, manifest: Manifest) -> None        # put_if_absent; Conflict on loss
# def read_manifest(store, keys, version: int) -> Manifest            # NotFound / ManifestError
# def latest_version(store, keys) -> int | None                       # listing, never cached
# def read_latest(store, keys) -> Manifest | None
# def manifest_exists(store, keys, version: int) -> bool              # the cheap probe

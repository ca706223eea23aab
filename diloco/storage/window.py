"""The guard's outlier window kept out of the manifests (trust rules 3, issue #44 invariant 6): the norms the
outlier rule judges by, their learners, the merge's median and bound, and each decision's figures (its norm,
a clip's scale, the outlier rule's numbers), in the merger's own small object.

Contract: `write_window` creates `<chain>/guard/<version>-<nonce>.json` exclusively, before the version's
manifest (which names it and its checksum: GuardState.window, and leaves the values out); `with_window` gives
a read manifest its values back from there (checked against the checksum), or as they are when the manifest
carries them inline (runs made before). Only the merger, the operator and audit call it: learners and the
evaluator never need the window, and their bucket policies do not grant its prefix — nothing they read
tells the bound (a learner knows its own deltas' norms: with the others' norms, or a clip's scale, it could
compute it).
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, ValidationError

from diloco.storage.codec.header import object_checksum
from diloco.storage.keys import RunKeys, new_nonce
from diloco.storage.manifest import (
    PRIVATE_DECISION,
    WINDOW_STATS,
    DeltaDecision,
    GuardState,
    Manifest,
    ManifestError,
    WindowRef,
    read_manifest,
)
from diloco.storage.store import Store

# RunRecord.trust_rules from which a run's merges keep the window here (records.TRUST_RULES)
KEPT_FROM_RULES = 3


class Judged(BaseModel):
    """One decision's figures (DeltaDecision's PRIVATE_DECISION fields)."""

    model_config = ConfigDict(extra="forbid")
    norm: float | None = None
    clip_scale: float | None = None
    detail: str = ""


class GuardWindow(BaseModel):
    """The window after one version of one chain."""

    model_config = ConfigDict(extra="forbid")
    run_id: str
    version: int
    norms: list[float] = []  # as GuardState.norms
    norm_learners: list[str] = []
    stats: dict[str, float] = {}  # the merge's outlier_median and outlier_bound, once the rule applies
    judged: list[Judged] = []  # the figures of each of the manifest's decisions, in its order


def write_window(store: Store, keys: RunKeys, version: int, guard: GuardState, stats: dict[str, float],
                 decisions: list[DeltaDecision] = ()) -> WindowRef:
    """Create the window object of `version` (exclusive, a fresh nonce) from the guard state after its merge,
    its stats and its decisions; the reference its manifest records."""
    judged = [Judged(**{name: getattr(d, name) for name in PRIVATE_DECISION}) for d in decisions]
    window = GuardWindow(run_id=keys.run_id, version=version, norms=list(guard.norms),
                         norm_learners=list(guard.norm_learners),
                         stats={k: stats[k] for k in WINDOW_STATS if k in stats}, judged=judged)
    data = json.dumps(window.model_dump(mode="json"), sort_keys=True, indent=1).encode()
    key = keys.guard_window(version, new_nonce())
    store.put_if_absent(key, data)
    return WindowRef(key=key, checksum=object_checksum(data))


def read_window(store: Store, keys: RunKeys, manifest: Manifest) -> GuardWindow:
    """The window object `manifest` names, checked (its checksum, run and version): ManifestError naming the
    key otherwise; NotFound/StorageError as the store raises them."""
    ref = manifest.guard.window
    if not ref.key.startswith(keys.guard_prefix()):
        raise ManifestError(f"version {manifest.version}: its window {ref.key!r} is not under "
                            f"{keys.guard_prefix()!r}")
    data = store.get(ref.key)
    if object_checksum(data) != ref.checksum:
        raise ManifestError(f"{ref.key}: checksum {object_checksum(data)} != recorded {ref.checksum}")
    try:
        window = GuardWindow.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(f"{ref.key}: malformed window: {exc}") from exc
    if (window.run_id, window.version) != (keys.run_id, manifest.version):
        raise ManifestError(f"{ref.key} says run {window.run_id!r} version {window.version}, expected "
                            f"{keys.run_id!r} version {manifest.version}")
    if len(window.judged) != len(manifest.decisions):
        raise ManifestError(f"{ref.key} holds the figures of {len(window.judged)} decisions, version "
                            f"{manifest.version} has {len(manifest.decisions)}")
    return window


def with_window(store: Store, keys: RunKeys, manifest: Manifest) -> Manifest:
    """`manifest` with its window's values in place (GuardState.norms, .norm_learners, the outlier stats, each
    decision's figures): read from its window object, or the manifest itself when it names none (its values
    inline)."""
    if manifest.guard is None or manifest.guard.window is None:
        return manifest
    window = read_window(store, keys, manifest)
    guard = manifest.guard.model_copy(update={"norms": window.norms, "norm_learners": window.norm_learners})
    decisions = [d.model_copy(update=j.model_dump()) for d, j in zip(manifest.decisions, window.judged,
                                                                       strict=True)]
    return manifest.model_copy(update={"guard": guard, "stats": {**manifest.stats, **window.stats},
                                       "decisions": decisions})


def read_full_manifest(store: Store, keys: RunKeys, version: int) -> Manifest:
    """Version `version`'s manifest with its window (with_window): what the merger, its replay, audit and the
    operator read."""
    return with_window(store, keys, read_manifest(store, keys, version))

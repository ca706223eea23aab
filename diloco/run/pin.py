"""run.json pinned: the root chain's version 0 records the BLAKE2b of run.json's bytes as created, and opening
the run and `audit` check it — a run.json overwritten since is named as such, never read as the run's config.

Contract: `pin_of(data)` is what creation records (Manifest.run_json_checksum); `pin_state(store, keys, data)`
is (ok, what): ok is False only when version 0 pinned other bytes than `data`. A run created before the pin
(its version 0 records none) or caught between run.json and version 0 still opens, and says so.
"""

from __future__ import annotations

from typing import Any

from diloco.storage import NotFound, RunKeys, StorageError, read_manifest
from diloco.storage.codec import object_checksum
from diloco.storage.store import Store

PINNED = "pinned by version 0"


def pin_of(data: bytes) -> str:
    """The checksum version 0 records for run.json's bytes (BLAKE2b-128, as every object of a manifest)."""
    return object_checksum(data)


def pin_state(store: Store, keys: RunKeys, data: bytes) -> tuple[bool, str]:
    """(ok, what) for run.json's bytes `data` against the pin in the root chain's version 0."""
    root = RunKeys(keys.run_id)
    try:
        pinned = read_manifest(store, root, 0).run_json_checksum
    except NotFound:
        return True, "not pinned yet: version 0 is not committed"
    except (StorageError, ValueError) as err:  # audit reports the manifest itself
        return True, f"not checked: version 0 is unreadable ({str(err)[:120]})"
    if not pinned:
        return True, ("not pinned: version 0 records no checksum of run.json (a run created before "
                      "run.json was pinned, or a fork)")
    have = pin_of(data)
    if have != pinned:
        return False, f"run.json changed since creation: its BLAKE2b is {have}, version 0 pinned {pinned}"
    return True, PINNED


def note_pin(report: Any, ok: bool, what: str) -> Any:
    """An audit report (inspect.audit.AuditReport) with the pin's state, and a changed run.json as its first
    problem (the replay, which would replay another config, skipped)."""
    report.run_json = what
    if not ok:
        report.ok = report.replay_ok = False
        report.problems.insert(0, f"{what} — the run's config is not the one it was created with; "
                                  "replay skipped")
    return report

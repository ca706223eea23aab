"""Every object key of a run is built here, and nowhere else (DESIGN §3).

Contract: names are validated before they become keys; no input can escape the run's prefix.
"""
# STUB — to be implemented. Signatures are the contract.

from __future__ import annotations

from dataclasses import dataclass


class KeyError_(ValueError):
    """A learner name, run id, version, seq or nonce is invalid; the message names it."""


def validate_learner_name(name: str) -> str:
    """`[a-z0-9-]{1,48}` or KeyError_ naming the bad value."""
    raise NotImplementedError


def validate_run_id(run_id: str) -> str:
    """`[a-z0-9][a-z0-9._-]{0,63}`, and not '.' / '..' — or KeyError_."""
    raise NotImplementedError


@dataclass(frozen=True)
class RunKeys:
    """The keys of one run, all under `<run_id>/`."""

    run_id: str

    def run_json(self) -> str: ...                       # <run>/run.json
    def versions_prefix(self) -> str: ...                # <run>/versions/
    def manifest(self, version: int) -> str: ...         # <run>/versions/<version:020d>.json
    def params(self, version: int, nonce: str) -> str: ...   # <run>/global/<version:020d>-<nonce>.params
    def update(self, version: int, nonce: str) -> str: ...   # <run>/global/<version:020d>-<nonce>.update
    def outer(self, version: int, nonce: str) -> str: ...    # <run>/global/<version:020d>-<nonce>.outer
    def deltas_prefix(self, learner: str | None = None) -> str: ...  # <run>/deltas/ or <run>/deltas/<learner>/
    def delta(self, learner: str, seq: int) -> str: ...      # <run>/deltas/<learner>/<seq:012d>.delta
    def learners_prefix(self) -> str: ...                # <run>/learners/
    def status(self, learner: str) -> str: ...           # <run>/learners/<learner>/status.json
    def checkpoint(self, learner: str, name: str) -> str: ...  # <run>/learners/<learner>/checkpoint/<name>
    def eval(self, version: int) -> str: ...             # <run>/evals/<version:020d>.json
    def evals_prefix(self) -> str: ...
    def event(self, source: str, name: str) -> str: ...  # <run>/events/<source>/<name>.jsonl
    def events_prefix(self) -> str: ...
    def stop(self) -> str: ...                           # <run>/control/stop
    def control(self, name: str) -> str: ...             # <run>/control/<name>


def parse_manifest_key(key: str) -> int | None:
    """The version of a manifest key, or None if the key is not a manifest."""
    raise NotImplementedError


def parse_delta_key(key: str) -> tuple[str, int] | None:
    """(learner, seq) of a delta key, or None if the key is not a well-formed delta key."""
    raise NotImplementedError


def new_nonce() -> str:
    """A fresh random nonce (16 hex chars) for objects written before a manifest."""
    raise NotImplementedError

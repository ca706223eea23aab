"""A learner's failure, recorded where the user looks: its status.json says `failed`, with the error's last
line, whether a restart can fix it, where its log is, and (once the supervisor left it down) `given_up`.

Contract: the learner writes it as its process fails (diloco.launch); the supervisor writes it for a process
that ended without saying why (killed, or dead before it could write: supervise/failures.py) and marks a
learner it gives up; the next start of the learner overwrites it with its own heartbeat. Recording never
raises (the bucket may be the trouble; the log still has the error); an error line is one line of at most
ERROR_CHARS characters.
"""

from __future__ import annotations

import logging
import os
import time

from diloco.storage import RunKeys, StorageError
from diloco.storage.records import LearnerStatus, RecordError, read_record, write_record
from diloco.storage.store import Store

log = logging.getLogger("diloco.failure")

# set by the local supervisor for each role's process: the absolute path of its log
LOG_ENV = "DILOCO_ROLE_LOG"
# the run's end when every learner was given up (their logs say why)
LEARNERS_CRASHED = "every learner crashed"
MERGER_FAILED = "the merger failed"  # the run's end when a merger was given up: "<this>: <its error line>"
ERROR_CHARS = 400


def error_line(text: str) -> str:
    """The text on one line (newlines folded), cut to ERROR_CHARS."""
    line = " ".join(text.split())
    return line if len(line) <= ERROR_CHARS else line[:ERROR_CHARS - 1] + "…"


def log_location() -> str | None:
    """Where this process's output goes, when its supervisor said (LOG_ENV)."""
    return os.environ.get(LOG_ENV) or None


def write_failed_status(store: Store, keys: RunKeys, learner: str, *, error: str, fatal: bool,
                        log_at: str | None, given_up: bool = False, pid: int | None = None) -> bool:
    """learners/<learner>/status.json as `failed` (its last figures kept, when it had a status); False when
    the bucket did not take it."""
    fields = {"error": error_line(error), "fatal": fatal, "log": log_at, "given_up": given_up or None}
    try:
        try:
            old = read_record(store, keys.status(learner), LearnerStatus).model_dump()
        except (StorageError, RecordError):
            old = {"learner": learner, "seq": -1, "base_version": -1, "step": 0, "cursor": 0,
                   "loss": float("nan"), "bytes_published": 0}
        status = LearnerStatus.model_validate({**old, "state": "failed", "t": time.time(),
                                               "pid": pid if pid is not None else old.get("pid", os.getpid()),
                                               **fields})
        write_record(store, keys.status(learner), status)
    except (StorageError, RecordError, ValueError) as err:
        log.warning("learner %s: its failure could not be recorded in the bucket: %s", learner, err)
        return False
    return True

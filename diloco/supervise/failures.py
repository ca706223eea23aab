"""What the supervisor learns when a learner's process fails, and what it records: the error's last line (the
learner's own `failed` status, else the tail of its log, else the exit), where its log is, whether a restart
can fix it.

Contract: a failed exit is a non-zero exit code or a FAILED / CRASHED flow run (a planned restart, a removal
and a run's own shutdown are not failures); read_failure never raises (storage trouble: what the backend
knows); the learner's status says `failed` once read_failure has run (written here when the process could not
write it), and `given_up` once the supervisor leaves it down (mark_given_up).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from diloco.run.context import RunContext
from diloco.run.failure import error_line, write_failed_status
from diloco.storage import StorageError
from diloco.storage.records import LearnerStatus, RecordError, read_record

TAIL_BYTES = 16_384  # of a log, read back for its last error line
# the line a failed role leaves last: launch's one-line user error ("error: ..."), or a traceback's last line
ERROR_LINE = re.compile(r"^(error: |[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b)")


@dataclass
class Failure:
    """One failed process of a learner, as the user should see it."""

    error: str  # one line
    log: str | None  # where its output is: a file, or a Prefect flow run
    fatal: bool  # a restart cannot fix it (a user error at the learner's start)

    def fields(self) -> dict[str, Any]:
        return {"error": self.error, "log": self.log, "fatal": self.fatal}


def failed_exit(detail: Any) -> bool:
    """Whether an exit code or a flow run's final state is a failure."""
    if isinstance(detail, int):
        return detail != 0
    return str(detail) in ("FAILED", "CRASHED")


def read_failure(ctx: RunContext, backend: Any, job: Any, detail: Any) -> Failure:
    """Why the job's latest process failed: the status it wrote as it failed (this process's, since
    job.started_at), else what the backend knows (its log's last error line, a flow run's state message);
    recorded in the learner's status when the process did not."""
    error, where = _backend_knows(backend, job)
    if job.role != "learner":  # a merger or the evaluator: no status of its own to read or write
        return Failure(error_line(error or (f"exit code {detail}" if isinstance(detail, int)
                                            else f"flow run {str(detail).lower()}")), where, False)
    store = ctx.store.with_retries(1)  # a bucket in trouble must not hold up the watch loop (and its lease)
    try:
        status = read_record(store, ctx.keys.status(job.name), LearnerStatus)
    except (StorageError, RecordError):
        status = None
    if status is not None and status.state == "failed" and status.t >= job.started_at and status.error:
        return Failure(status.error, status.log or where, bool(status.fatal))
    if isinstance(detail, int) and detail < 0:  # killed (out of memory, or by the supervisor: no heartbeat):
        error = f"killed by signal {-detail}"  # the log's last lines are what it did before, not why it ended
    elif not error:
        error = f"exit code {detail}" if isinstance(detail, int) else f"flow run {str(detail).lower()}"
    failure = Failure(error_line(error), where, False)
    pid = int(job.history[-1]) if job.history and job.history[-1].isdigit() else None
    write_failed_status(store, ctx.keys, job.name, error=failure.error, fatal=False, log_at=where, pid=pid)
    return failure


def mark_given_up(ctx: RunContext, job: Any, failure: Failure | None) -> None:
    """The learner's status says `failed`, given up: the supervisor will not start it again."""
    failure = failure or Failure("left down: it ended too many times in a row", None, False)
    write_failed_status(ctx.store.with_retries(1), ctx.keys, job.name, error=failure.error,
                        fatal=failure.fatal, log_at=failure.log, given_up=True)


def _backend_knows(backend: Any, job: Any) -> tuple[str | None, str | None]:
    """(an error line, where the log is) from the backend, when it has a `failure_detail`."""
    detail = getattr(backend, "failure_detail", None)
    return detail(job) if detail is not None else (None, None)


def last_error_line(path: str | None) -> str | None:
    """The last line of a log that reads as an error (ERROR_LINE), else its last non-empty line; None without
    one."""
    if not path or not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - TAIL_BYTES))
        lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.match(line)]
    return (errors or lines or [None])[-1]

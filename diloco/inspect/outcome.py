"""How a run ended, for the user and the exit code: what ended it, whether short of its target, which learners
failed (each one's last error line and where its log is), and whether the run failed (`RunFailed`, EXIT_CODE).

Contract: read from the bucket alone (the learners' status records, the supervisor's `exit` events,
control/stop, the manifests), so `diloco summary` later says what `diloco run` said. Success: the target
(versions or token budget), the user's own stop (`diloco stop`, Ctrl-C, SIGTERM), or the time limit when
nothing failed (said in one line: `ended_by` "time limit", `short_of_target`). Failure: a learner that failed
for a reason a restart cannot fix or was given up, no delta merged at all, an end the user did not ask for
(every learner crashed, the supervisor's lease lost, an error), or a time limit that ended the run short after
learner failures of this session.
"""

from __future__ import annotations

import os
from typing import Any

from diloco.run.failure import LEARNERS_CRASHED, MERGER_FAILED
from diloco.run.state import RunState

EXIT_CODE = 3  # `diloco run` / `diloco resume` of a run that failed (2: a bad argument; 130 / 143: a signal)
USER_ENDS = ("stop", "interrupted", "terminated")  # ended_by values the user asked for
OWN_BUDGET = ("target", "time limit", *USER_ENDS)  # ends that are not a failure by themselves


class RunFailed(RuntimeError):
    """A run that failed (see diloco.inspect.outcome): `diloco.train` raises it once the run has ended;
    `reason` is the one line (also the message), `summary` what `diloco run --json` prints."""

    def __init__(self, reason: str, summary: dict[str, Any]) -> None:
        super().__init__(reason)
        self.reason, self.summary = reason, summary


def ended_by(state: RunState) -> str | None:
    """"target", "time limit", "stop" (the user's `diloco stop`, any reason), "interrupted", "terminated",
    "learners crashed" or "error" (the supervisor's lease lost, a lost supervisor, an exception); None while
    not ended."""
    if state.word == "finished":
        return "target"
    if state.word != "stopped":
        return None
    reason = state.reason or ""
    if reason.startswith("time limit"):
        return "time limit"
    if reason in ("interrupted", "terminated"):
        return reason
    if reason == LEARNERS_CRASHED:
        return "learners crashed"
    if reason == "lease lost" or reason.startswith(("supervisor lost", "error:", MERGER_FAILED)):
        return "error"
    return "stop"  # `diloco stop --reason ...`, "target version" of a run resumed past it, a test's "done"


def failed_learners(rows: list[dict[str, Any]], events: list[dict[str, Any]],
                    since: float) -> list[dict[str, Any]]:
    """Every learner with a failed process since `since` (the supervisor's `exit` events carrying an error) or
    whose status says failed: its last error line, its log, how many failures, fatal (a restart cannot fix
    it), given_up (left down), down (its status still says failed)."""
    out: dict[str, dict[str, Any]] = {}
    for event in events:
        if event.get("kind") in ("exit", "give_up") and event.get("error") and event.get("t", 0) >= since \
                and event.get("role",
                              "learner") == "learner":  # a merger's failure ends the run (MERGER_FAILED)
            row = out.setdefault(event["learner"],
                                 {"learner": event["learner"], "failures": 0, "fatal": False,
                                  "given_up": False, "down": False})
            row["failures"] += event["kind"] == "exit"
            row.update(error=event["error"], log=event.get("log"), fatal=bool(event.get("fatal")))
            row["given_up"] |= event["kind"] == "give_up"
    for status in rows:
        if status.get("state") == "failed" and status.get("t", 0) >= since:
            row = out.setdefault(status["learner"], {"learner": status["learner"], "failures": 1})
            row.update(error=status.get("error") or "failed", log=status.get("log") or row.get("log"),
                       fatal=bool(status.get("fatal")), given_up=bool(status.get("given_up")), down=True)
    return [out[name] for name in sorted(out)]


def failure_of(ended: str | None, state: RunState, failed: list[dict[str, Any]],
               deltas_merged: int) -> str | None:
    """The one line saying why the run failed, or None (module contract)."""
    reasons = []
    fatal = [f for f in failed if f["fatal"]]
    given_up = [f for f in failed if f.get("given_up") and f not in fatal]
    if fatal:
        reasons.append(f"{_names(fatal)} failed, and a restart cannot fix it: {fatal[0]['error']}")
    if given_up:
        reasons.append(f"{_names(given_up)} failed {_times(given_up[0]['failures'])} and was left down: "
                       f"{given_up[0]['error']}")
    if ended is not None and ended not in OWN_BUDGET:
        reasons.append(f"the run ended at {state.where()}: {state.reason}")
    if ended is not None and ended not in USER_ENDS and deltas_merged == 0:
        reasons.append("no learner contributed (not one delta merged)")
    if ended == "time limit" and failed and not reasons:
        reasons.append("the time limit ended it short of its target after learner failures: "
                       f"{_names(failed)}: {failed[-1]['error']}")
    return "; ".join(reasons) or None


def _times(n: int) -> str:
    return f"{n} time{'' if n == 1 else 's'}"


def _names(failed: list[dict[str, Any]]) -> str:
    names = [f["learner"] for f in failed]
    return f"learner {names[0]}" if len(names) == 1 else f"learners {', '.join(names)}"


def run_outcome(state: RunState, rows: list[dict[str, Any]], events: list[dict[str, Any]],
                deltas_merged: int) -> dict[str, Any]:
    """The summary's outcome keys: ended_by, short_of_target (None while not ended), failed_learners,
    failure."""
    since = state.lease.started_at if state.lease is not None else 0.0  # this supervisor session's
    ended = ended_by(state)
    failed = failed_learners(rows, events, since)
    return {"ended_by": ended, "short_of_target": None if ended is None else ended != "target",
            "failed_learners": failed, "failure": failure_of(ended, state, failed, deltas_merged)}


def failure_cells(failed: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(learner, how it failed: its last error line and where its log is) per failed learner."""
    def how(f: dict[str, Any]) -> str:
        if f.get("fatal"):
            return "failed; a restart cannot fix it"
        if f.get("given_up"):
            return f"failed {_times(f['failures'])}, left down"
        return f"failed {_times(f['failures'])}, restarted"

    return [(f["learner"], f"{how(f)}: {f['error']} (log: {f.get('log') or 'none'})") for f in failed]


def failure_lines(failed: list[dict[str, Any]]) -> list[str]:
    """One line per failed learner (failure_cells)."""
    return [f"learner {name} {text}" for name, text in failure_cells(failed)]


def status_failure_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The live table's and `diloco status`'s: one line per learner whose status says failed (a log under the
    current folder by its relative path: the table is narrow)."""
    return [f"learner {r['learner']} failed{'; a restart cannot fix it' if r.get('fatal') else ''}"
            f"{', left down' if r.get('given_up') else ''}: {r.get('error') or '?'} (log: "
            f"{_near(r.get('log'))})"
            for r in rows if r.get("state") == "failed"]


def _near(path: str | None) -> str:
    if not path:
        return "none"
    if os.path.isabs(path) and path.startswith(os.getcwd() + os.sep):
        return os.path.relpath(path)
    return path

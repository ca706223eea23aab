"""Operator control ops: admit, remove, readmit, pause-merges, resume-merges, set, resume, fork — each one
object, control/ops/<time ns>-<nonce>.json, with what, the values, when and by whom.

Contract: an op is written once by exclusive create and never changed, after its inputs were validated (a bad
one raises RunError/ConfigError and writes nothing); ops sort by name in the order they were made; the merger
applies the ones after its cursor at its next merge and records them in that manifest (trust/guard.py);
every op is also an event of source "operator"; membership (who may publish) is run.json's learners plus the
admitted, minus the removed.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from diloco.configs import ConfigError
from diloco.run.events import EventLog
from diloco.storage import Conflict, NotFound, RunKeys
from diloco.storage.keys import InvalidName, new_nonce, parse_op_key
from diloco.storage.records import ControlOp, RecordError, finite_json, read_record, write_record
from diloco.storage.store import Store

# set by `diloco resume`; read by every role at its start
RUN_KEYS = ("run.num_versions", "run.num_tokens", "run.time_limit_s")


def operator_identity() -> str:
    """Who is acting: DILOCO_OPERATOR when set (a Prefect flow run passes its own name), else user@host."""
    if os.environ.get("DILOCO_OPERATOR"):
        return os.environ["DILOCO_OPERATOR"]
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name in this container's passwd or environment
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def list_ops(store: Store, keys: RunKeys, after: str = "") -> list[str]:
    """The names of the run's control ops after `after` (one fresh listing from its key on), in order."""
    start = ""
    if after:
        with contextlib.suppress(InvalidName):  # a cursor that is no op's name: the whole listing, filtered
            start = keys.op(after)
    names = (parse_op_key(k) for k in store.list(keys.ops_prefix(), start))
    return sorted(n for n in names if n is not None and n > after)


def read_op(store: Store, keys: RunKeys, name: str) -> ControlOp:
    """One op; NotFound if absent, RecordError if it does not parse."""
    return read_record(store, keys.op(name), ControlOp)


def read_ops(store: Store, keys: RunKeys, after: str = "") -> list[tuple[str, ControlOp | RecordError]]:
    """(name, op or the error that makes it unusable) for every op after `after`, in order."""
    out: list[tuple[str, ControlOp | RecordError]] = []
    for name in list_ops(store, keys, after):
        try:
            out.append((name, read_op(store, keys, name)))
        except RecordError as err:
            out.append((name, err))
        except NotFound:
            continue
    return out


class OpsFeed:
    """The run's control ops as the chains of one merger process read them: the ops are the run's, not a
    chain's, so one listing (and the ops it read) serves every chain that asks within `fresh_s` of it, and a
    reader that must see the newest (a wait's start, a merge) lists again. A shard of 8 chains lists the ops
    about once a second instead of 8 times; an op reaches each chain's policy within 2 x fresh_s."""

    def __init__(self, store: Store, keys: RunKeys, fresh_s: float) -> None:
        self.store, self.keys, self.fresh_s = store, keys, fresh_s
        self._lock = threading.Lock()
        self._after: str | None = None  # the cursor the held listing started after (None: nothing held)
        self._at = 0.0  # when it was made (time.monotonic())
        self._entries: list[tuple[str, ControlOp | RecordError]] = []

    def read(self, after: str = "", newest: bool = True) -> list[tuple[str, ControlOp | RecordError]]:
        """read_ops(after): listed now when `newest`, otherwise from a listing made under fresh_s ago."""
        with self._lock:
            now = time.monotonic()
            if newest or self._after is None or after < self._after or now - self._at >= self.fresh_s:
                self._entries, self._after, self._at = read_ops(self.store, self.keys, after), after, now
            return [(name, op) for name, op in self._entries if name > after]


def _next_name(store: Store, keys: RunKeys) -> str:
    """After every op listed now and not before the clock: a late clock never files an op behind others."""
    names = list_ops(store, keys)
    stamp = time.time_ns()
    if names:
        stamp = max(stamp, int(names[-1].split("-")[0]) + 1)
    return f"{stamp:020d}-{new_nonce()[:8]}"


def write_op(store: Store, keys: RunKeys, kind: str, *, learner: str | None = None,
             values: dict[str, Any] | None = None, reason: str = "", by: str | None = None) -> str:
    """Record one op (exclusive create, a fresh name on the rare collision) and its event; returns its name.
    ConfigError, and nothing written, for a value JSON cannot carry exactly (inf, nan)."""
    bad = [k for k, v in (values or {}).items() if not finite_json(v)]
    if bad:
        raise ConfigError(f"{bad[0]}={(values or {})[bad[0]]!r}: must be finite (no inf or nan)")
    op = ControlOp(kind=kind, t=time.time(), by=by or operator_identity(), learner=learner,
                   values=values or {}, reason=reason)
    for _ in range(5):
        name = _next_name(store, keys)
        try:
            write_record(store, keys.op(name), op, exclusive=True)
            break
        except Conflict:
            continue
    else:
        raise Conflict(f"could not file a control op in {keys.ops_prefix()} (5 names taken)")
    events = EventLog(store, keys, "operator")
    events.emit(kind, op=name, by=op.by, **({"learner": learner} if learner else {}), values=op.values,
                reason=reason)
    events.flush()  # never raises: a failed flush keeps its events (the op itself is the record)
    return name


@dataclass(frozen=True)
class Membership:
    """Who may publish in a run, from run.json's learners and the admit/remove ops; `supervised`: the members
    a supervisor starts (run.json's and those admitted with start on — not, e.g., a writer admitted by a
    test)."""

    members: tuple[str, ...]
    removed: tuple[str, ...]
    supervised: tuple[str, ...] = ()

    def admitted(self, learner: str) -> bool:
        return learner in self.members


def membership(store: Store, keys: RunKeys, learners: list[str]) -> Membership:
    """The membership now (ops not yet applied by a merge included): run.json learners + admitted -
    removed."""
    members, removed, unsupervised = set(learners), set(), set()
    for _, op in read_ops(store, keys):
        if isinstance(op, RecordError) or op.learner is None:
            continue
        if op.kind == "admit" and op.learner not in removed:
            members.add(op.learner)
            if op.values.get("start") is False:
                unsupervised.add(op.learner)
        elif op.kind == "remove":
            members.discard(op.learner)
            removed.add(op.learner)
    return Membership(tuple(sorted(members)), tuple(sorted(removed)), tuple(sorted(members - unsupervised)))


def run_overrides(store: Store, keys: RunKeys) -> dict[str, Any]:
    """The run settings (RUN_KEYS) the newest `resume` op set: what every role reads at its start."""
    out: dict[str, Any] = {}
    try:
        ops = read_ops(store, keys)
    except NotFound:
        return out
    for _, op in ops:
        if not isinstance(op, RecordError) and op.kind == "resume":
            out.update({k: v for k, v in op.values.items() if k in RUN_KEYS})
    return out


__all__ = ["RUN_KEYS", "Membership", "list_ops", "membership", "operator_identity", "read_op", "read_ops",
           "run_overrides", "write_op"]

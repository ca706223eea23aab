"""The operator's controls — the functions the CLI (diloco/cli/operate.py), the Python facade
(diloco.api.operate) and the Prefect `operate` flow call: admit, remove, readmit, pause and resume merges,
live settings, prepare a resume (fork: diloco.inspect.fork, which replays merges from the log).

Contract: each control validates its input against the run as it is now (the newest manifest plus the ops
not merged yet) and raises RunError / ConfigError / InvalidName naming the problem with nothing written;
otherwise it files one control op (who, when, what) — also an event — which the merger applies at its next
merge and records in that manifest; `by` defaults to user@host (DILOCO_OPERATOR overrides it). Nothing here
supervises: `resume`, which also runs the roles, is diloco.api.operate's.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from diloco.configs import ConfigError, config_from_record, parse_value
from diloco.run.context import RunContext, RunError, open_run
from diloco.run.controls import write_op
from diloco.run.fragments import run_version
from diloco.run.target import run_tokens, target_reached
from diloco.storage import StorageError, open_store
from diloco.storage.keys import validate_learner_name, validate_new_learner_name
from diloco.storage.records import FINAL_STATES, LearnerStatus, RecordError, RunRecord, beat_age, read_record
from diloco.storage.store import Store

QUIET_S = 5.0  # a stopped run's roles beat at most this recently once they have all ended
QUIET_WAIT_S = 30.0  # `resume` waits this long for the roles of a stopping run to end
log = logging.getLogger("diloco.operate")


def _ctx(storage: str | Store | RunContext, run_id: str | None) -> RunContext:
    if isinstance(storage, RunContext):
        return storage
    if run_id is None:
        raise RunError("a run id is needed")
    return open_run(open_store(storage) if isinstance(storage, str) else storage, run_id)


def _policy(ctx: RunContext):
    from diloco.trust.view import current_policy

    return current_policy(ctx)[1]


def admit_learner(storage: str | Store | RunContext, run_id: str | None, learner: str, *, reason: str = "",
                  start: bool = True, by: str | None = None) -> str:
    """Admit one more learner (elastic join): its deltas are merged from the next merge on, and a running
    supervisor starts it (unless `start` is False: it runs elsewhere, by hand); returns the op."""
    validate_new_learner_name(learner)
    ctx = _ctx(storage, run_id)
    state = _policy(ctx).state
    if learner in state.removed:
        raise RunError(f"learner {learner} was removed from run {ctx.run_id}; removal is for good (admit a "
                       "new name)")
    if learner in state.members:
        raise RunError(f"learner {learner} is already admitted to run {ctx.run_id}")
    return write_op(ctx.store, ctx.keys, "admit", learner=learner, values={"start": start}, reason=reason,
                    by=by)


def remove_learner(storage: str | Store | RunContext, run_id: str | None, learner: str, *,
                   reason: str = "operator", by: str | None = None) -> None:
    """Take a learner out for good: it ends after its phase, is never restarted, its deltas are rejected."""
    from diloco.run.signals import request_remove

    validate_learner_name(learner)
    ctx = _ctx(storage, run_id)
    state = _policy(ctx).state
    if learner in state.removed:
        raise RunError(f"learner {learner} is already removed from run {ctx.run_id}")
    if learner not in state.members:
        raise RunError(f"learner {learner!r} is not in run {ctx.run_id!r} (its learners: "
                       f"{', '.join(state.members)})")
    if state.members == [learner]:
        raise RunError(f"learner {learner} is the last member of run {ctx.run_id}: without it nobody trains "
                       "and the run would idle to its time limit; admit another learner first, or `diloco "
                       "stop` the run")
    request_remove(ctx, learner, reason, by=by)


def readmit(storage: str | Store | RunContext, run_id: str | None, learner: str, *, reason: str = "",
            by: str | None = None) -> str:
    """End a learner's quarantine: its next deltas are judged again."""
    validate_learner_name(learner)
    ctx = _ctx(storage, run_id)
    state = _policy(ctx).state
    if learner not in state.quarantined:
        quarantined = ", ".join(state.quarantined) or "none"
        raise RunError(f"learner {learner} is not quarantined in run {ctx.run_id} (quarantined: "
                       f"{quarantined})")
    return write_op(ctx.store, ctx.keys, "readmit", learner=learner, reason=reason, by=by)


def pause_merges(storage: str | Store | RunContext, run_id: str | None = None, *, reason: str = "",
                 by: str | None = None) -> str:
    """Pause merging (learners train on and publish; their deltas wait in the bucket)."""
    ctx = _ctx(storage, run_id)
    if _policy(ctx).state.paused:
        raise RunError(f"merges of run {ctx.run_id} are already paused")
    return write_op(ctx.store, ctx.keys, "pause-merges", reason=reason, by=by)


def resume_merges(storage: str | Store | RunContext, run_id: str | None = None, *, reason: str = "",
                  by: str | None = None) -> str:
    """Resume merging: the next merge takes everything that arrived meanwhile."""
    ctx = _ctx(storage, run_id)
    if not _policy(ctx).state.paused:
        raise RunError(f"merges of run {ctx.run_id} are not paused")
    return write_op(ctx.store, ctx.keys, "resume-merges", reason=reason, by=by)


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """`key=value` strings -> {key: value}, each value read by its config field's type (configs.values: `off`
    is a string for a Literal field, `true` is no integer, no inf or nan), free-form ones as YAML."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{item!r} is not key=value (e.g. merger.quorum=3)")
        values[key.strip()] = parse_value(key.strip(), text)
    return values


def set_settings(storage: str | Store | RunContext, run_id: str | None, values: dict[str, Any] | list[str], *,
                 reason: str = "", by: str | None = None, force: bool = False) -> str:
    """Change live settings (trust/guard.py LIVE_SETTINGS) from the next merge on: typed, finite and validated
    by the config (trust/settings.py); one that would reject the deltas the run sends now only with `force`.
    """
    from diloco.trust.settings import check_live

    if isinstance(values, list):
        values = parse_assignments(values)
    if not values:
        raise ConfigError("nothing to set: give key=value pairs, e.g. merger.quorum=3")
    ctx = _ctx(storage, run_id)
    typed = check_live(ctx, _policy(ctx), values, force=force)
    return write_op(ctx.store, ctx.keys, "set", values=typed, reason=reason, by=by)


def _newest_beat(ctx: RunContext) -> tuple[str, float] | None:
    """(learner, age in seconds) of the newest heartbeat, or None; a learner's final status (finished,
    stopped, removed: written as it ended) is no sign of life, nor is a beat from the future
    (records.beat_age: ignored, and said)."""
    newest: tuple[str, float] | None = None
    now = time.time()
    for key in ctx.store.list(ctx.keys.learners_prefix()):
        parts = key.split("/")
        if parts[-1] != "status.json":
            continue
        try:
            status = read_record(ctx.store, key, LearnerStatus)
        except (StorageError, RecordError):
            continue
        if status.state in FINAL_STATES:
            continue
        age = beat_age(status.t, now)
        if age is None:
            log.warning("learner %s: its heartbeat is %.0fs ahead of this clock: ignored", parts[-2],
                        status.t - now)
            continue
        if newest is None or age < newest[1]:
            newest = (parts[-2], age)
    return newest


def run_state(ctx: RunContext) -> str:
    """"stopped" (control/stop), "finished" (the target version committed, or the token budget), "live" (a
    learner beat within run.heartbeat_timeout_s), else "idle" (nothing runs: a crashed or never started
    session)."""
    if ctx.store.exists(ctx.keys.stop()):
        return "stopped"
    if target_reached(ctx):
        return "finished"
    beat = _newest_beat(ctx)
    return "live" if beat is not None and beat[1] < ctx.cfg.run.heartbeat_timeout_s else "idle"


def _wait_quiet(ctx: RunContext, wait_s: float) -> None:
    deadline = time.time() + wait_s
    while True:
        beat = _newest_beat(ctx)
        if beat is None or beat[1] >= QUIET_S:
            return
        if time.time() >= deadline:
            raise RunError(f"run {ctx.run_id} is stopping but learner {beat[0]} beat {beat[1]:.0f}s ago: "
                           "wait for its roles to end, then resume")
        time.sleep(1.0)


def prepare_resume(storage: str | Store | RunContext, run_id: str | None, *, versions: int | None = None,
                   time_limit_s: float | None = None, by: str | None = None,
                   wait_s: float = QUIET_WAIT_S) -> dict[str, Any]:
    """Make a finished, stopped or idle run continue: the target becomes the newest version + `versions`
    (default: run.json's run.num_versions more), the time limit `time_limit_s` (default run.json's), the stop
    is cleared. The roles started next (diloco.api.supervise) rejoin at the newest version. The plan's
    `prefect`: whether the run's last supervisor reported to Prefect (its lease's kind; True for a run never
    supervised)."""
    ctx = _ctx(storage, run_id)
    record = read_record(ctx.store, ctx.keys.run_json(), RunRecord)
    base = config_from_record(record.config)
    more = base.run.num_versions if versions is None else versions
    limit = base.run.time_limit_s if time_limit_s is None else time_limit_s
    if isinstance(more, bool) or not isinstance(more, int) or more < 1:
        raise ConfigError(f"--versions {more!r} must be an int >= 1 (versions to add)")
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not (0 < limit < math.inf):
        raise ConfigError(f"--time-limit-s {limit!r} must be a finite number of seconds > 0")
    from diloco.run.lease import held_error, is_live, read_current

    lease = read_current(ctx.store, ctx.keys)
    if is_live(lease):  # checked before anything is written: a supervised run is never changed under it
        raise held_error(ctx, lease)
    state = run_state(ctx)
    if state == "live":
        raise RunError(f"run {ctx.run_id} is live (its learners beat within "
                       f"{ctx.cfg.run.heartbeat_timeout_s:g}s): "
                       "change it with `diloco set`, or `diloco stop` it first")
    latest = run_version(ctx) or 0  # fragments: the slowest fragment's version
    values = {"run.num_versions": latest + more, "run.time_limit_s": float(limit)}
    if base.run.num_tokens > 0:  # a token budget grows by run.json's budget again (and the versions as above)
        values["run.num_tokens"] = run_tokens(ctx) + base.run.num_tokens
    ctx.cfg.with_overrides(values)  # validated before anything is written
    if state == "stopped":
        _wait_quiet(ctx, wait_s)
    op = write_op(ctx.store, ctx.keys, "resume", values=values, by=by,
                  reason=f"resume of a {state} run at version {latest}: {more} more versions")
    ctx.store.delete(ctx.keys.stop())
    return {"run_id": ctx.run_id, "state": state, "latest": latest,
            "previous_target": ctx.cfg.run.num_versions,
            "target": latest + more, "time_limit_s": float(limit), "op": op,
            "prefect": lease is None or lease.kind != "local"}

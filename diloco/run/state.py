"""Where a run stands, read from the bucket: running, finished, stopped, or idle — and how to continue it.

Contract: read-only; "finished" means the target version is committed (or the token budget merged, on every
chain: run/target.py), "stopped" that control/stop exists (with its reason), "running" that a supervisor holds
a live lease, "idle" anything else (never supervised, or its supervisor vanished before anyone recorded a
stop: `diloco run` takes it up again).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.run.context import RunContext, RunError
from diloco.run.lease import describe, held_error, is_live, read_current
from diloco.run.signals import read_stop_reason
from diloco.run.target import run_progress
from diloco.storage.records import FINAL_STATES, SupervisorLease

ENDED = ("finished", "stopped")


@dataclass
class RunState:
    word: str  # running | finished | stopped | idle
    version: int  # the newest committed version
    target: int  # run.num_versions
    reason: str | None = None  # control/stop's reason (stopped)
    lease: SupervisorLease | None = None  # the current supervisor session, if any
    tokens: int = 0  # merged by the run (read only with a token budget)
    budget: int = 0  # run.num_tokens (0: no token budget)

    @property
    def ended(self) -> bool:
        return self.word in ENDED

    def where(self) -> str:
        """`version 9 of 40`, or with a token budget `version 9, 460,800 of 6,000,000 tokens`."""
        if self.budget > 0:
            return f"version {self.version}, {self.tokens:,} of {self.budget:,} tokens"
        return f"version {self.version} of {self.target}"

    def title(self) -> str:
        """`finished: version 20 of 20`, `stopped at version 9 of 40 (interrupted)`, `running (pid …)`."""
        if self.word == "finished":
            return f"finished: {self.where()}"
        if self.word == "stopped":
            return f"stopped at {self.where()} ({self.reason})"
        if self.word == "running" and self.lease is not None:
            return f"running: {self.where()}, supervised by {describe(self.lease)}"
        return f"{self.word}: {self.where()}"


def read_run_state(ctx: RunContext) -> RunState:
    target, budget = ctx.cfg.run.num_versions, ctx.cfg.run.num_tokens
    progress = run_progress(ctx)  # the target version, or the token budget (run.num_tokens), on every chain
    version, tokens = progress.version or 0, progress.tokens
    lease = read_current(ctx.store, ctx.keys)
    if progress.reached:
        return RunState("finished", version, target, read_stop_reason(ctx), lease, tokens, budget)
    if ctx.store.exists(ctx.keys.stop()):
        return RunState("stopped", version, target, read_stop_reason(ctx) or "stop requested", lease, tokens,
                        budget)
    return RunState("running" if is_live(lease) else "idle", version, target, None, lease, tokens, budget)


def continue_hint(ctx: RunContext) -> str:
    """The line that tells a user how to go on with an ended run (`diloco resume`, issue #14)."""
    return f"continue with: diloco resume --run-id {ctx.run_id} --storage {ctx.store.url}"


def ended_note(ctx: RunContext) -> str | None:
    """For a control filed on a finished or stopped run (an op, a removal): the line that says it applies only
    once the run is resumed; None for a run that is not over."""
    state = read_run_state(ctx)
    if not state.ended:
        return None
    return (f"run {ctx.run_id!r} has ended ({state.title()}): this applies when it is resumed; "
            f"{continue_hint(ctx)}")


def refuse_if_ended(ctx: RunContext, doing: str) -> RunState:
    """RunError (one line, exit 2) when the run is finished or stopped: `doing` it would do nothing."""
    state = read_run_state(ctx)
    if state.ended:
        raise RunError(f"run {ctx.run_id!r} is {state.title()}: nothing to {doing}; {continue_hint(ctx)}")
    return state


def refuse_to_start(ctx: RunContext) -> RunState:
    """Before supervising: RunError if the run ended, LeaseHeld if another supervisor is live."""
    state = refuse_if_ended(ctx, "train")
    if state.word == "running" and state.lease is not None:
        raise held_error(ctx, state.lease)
    return state


def learner_word(status_state: str | None, removed: bool, run: RunState) -> str:
    """What `diloco status` calls a learner: its own final state, else removed, else the run's end, else
    the state its heartbeat last said (a learner killed at the end never wrote a final state)."""
    if status_state in FINAL_STATES:
        return status_state
    if removed:
        return "removed"
    if run.ended:
        return run.word
    return status_state or "never reported"

"""The local supervisor: one OS process per learner, the merger and the evaluator; self-healing.

Contract: a crashed or silent learner is restarted (with back-off; at most max_restarts times in a
row without a healthy stretch) and rejoins from the newest version; a planned restart (chaos,
operator) or a pause is not a crash; the run ends when the target version is committed, a stop is
requested (`diloco stop`) or the time limit passes; shutdown leaves no process of the run behind (warm standbys included).

Start method (`run.start_method`): "fork" (local runs without Prefect) forks every role from a zygote
(diloco.zygote), one process that paid the imports once: a (re)start is a fork and a join, and
no spares are kept. A process's `start` event is stamped when the start was asked for, so the zygote's
own imports at the first start are charged to the roles' start-up, as an exec start's imports are.

Warm standby (`run.warm_standby`, exec only): each learner has a spare process that has paid the imports
(torch, torch._dynamo via the optimizer, the model code; prefect and the flow module on the Prefect
path) and waits, blocked on its stdin, without touching the bucket. A (re)start of the learner
writes one line to the spare (it then opens the run, builds the Learner and joins the newest
version) and a new spare is started for next time; a planned restart still waits its delay first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco.run.events import EventLog
from diloco.run.loops import StopSignal, request_stop
from diloco.run.context import RunContext
from diloco.zygote import Forked, Zygote, ZygoteError
from diloco.storage import NotFound, StorageError, latest_version

log = logging.getLogger("diloco.supervisor")


@dataclass
class Proc:
    role: str  # "learner" | "merger" | "evaluator"
    name: str
    popen: subprocess.Popen | Forked | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0  # back-off: not before this time
    removed: bool = False  # an operator (or a chaos plan) stopped it on purpose
    paused: bool = False
    exits: list[int] = field(default_factory=list)
    planned_restart_at: float | None = None  # a planned restart (chaos, operator): not a crash
    resumed_at: float = 0.0  # heartbeat grace restarts here after a pause
    standby: subprocess.Popen | None = None  # the warm spare of a learner, blocked on its stdin
    standby_next: float = 0.0  # a spare that died is respawned, not before this time
    deferred_until: float | None = None  # first start waits for the learners' joins (the evaluator)
    joined_pid: int | None = None  # the process whose join was seen in its status object: read no more

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


JOIN_WAIT_S = 30.0  # what waits for learners to join does so at most this long: the evaluator's first start
# (its imports would slow the learners' cold start; not the merger's: learners that joined before it pile up a
# backlog), and a learner's next spare (warming it up earlier competes with the learner's own imports and join)


def cli_command(role: str, ctx: RunContext, name: str, prefect: bool, standby: bool = False) -> list[str]:
    """The command line that runs one role of a run in its own process (a learner's warm spare: `--standby`)."""
    base = [sys.executable, "-m", "diloco.cli"]
    common = ["--storage", ctx.store.url, "--run-id", ctx.run_id]
    flag = ["--prefect"] if prefect else ["--no-prefect"]
    if role == "learner":
        return [*base, "learner", *common, "--learner", name, *flag, *(["--standby"] if standby else [])]
    if role == "merger":
        return [*base, "merge", *common, "--merger-id", name, *flag]
    return [*base, "evaluate", *common, *flag]


class Supervisor:
    """Start every role as a process, watch them, restart what crashed, stop at the target."""

    def __init__(self, ctx: RunContext, *, prefect: bool = False, events: EventLog | None = None,
                 env: dict[str, str] | None = None, log_dir: str | None = None) -> None:
        self.ctx, self.cfg, self.prefect = ctx, ctx.cfg, prefect
        self.events = events or EventLog(ctx.store, ctx.keys, "supervisor")
        self.env = {**os.environ, **(env or {})}
        self.log_dir = log_dir
        self.procs: dict[str, Proc] = {}
        self.hooks: list[Callable[[Supervisor], None]] = []  # chaos agents, progress displays
        self.started_at = time.time()
        self.forking = not prefect and self.cfg.run.start_method == "fork"
        self.zygote: Zygote | None = None

    # ---- processes -----------------------------------------------------------------------
    def add(self, role: str, name: str) -> Proc:
        proc = Proc(role, name)
        self.procs[name] = proc
        return proc

    def _log_path(self, name: str) -> str | None:
        """Where a process of this name logs (the folder is made), or None without a log_dir."""
        if not self.log_dir:
            return None
        os.makedirs(self.log_dir, exist_ok=True)
        return os.path.join(self.log_dir, f"{name}.log")

    def _popen(self, cmd: list[str], name: str, stdin: int) -> subprocess.Popen:
        log_path = self._log_path(name)
        if log_path is None:
            return subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                    stdin=stdin, start_new_session=True)
        with open(log_path, "ab") as out:  # the child keeps its own copy
            return subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=stdin,
                                    start_new_session=True)

    def _fork(self, cmd: list[str], name: str) -> Forked | None:
        """Fork the role from the zygote (started on first use); None (and exec from now on) if it fails."""
        try:
            if self.zygote is None:
                self.zygote = Zygote(self.env, f"--run-id={self.ctx.run_id}", self._log_path("zygote"))
            return self.zygote.spawn(cmd[3:], self._log_path(name), self.env, name)
        except (ZygoteError, OSError) as err:
            log.warning("zygote unavailable (%s): starting processes with exec from now on", err)
            self.events.emit("zygote_failed", reason=str(err))
            self.forking = False
            return None

    def spawn(self, proc: Proc, asked: float | None = None) -> None:
        """Start a role's process: forked from the zygote, or a live warm spare (learners), or exec.
        `asked`: when the start was asked for (start_all starts several roles at once), default now."""
        asked = asked or time.time()
        if proc.role == "learner" and self._activate_standby(proc):
            return
        cmd = cli_command(proc.role, self.ctx, proc.name, self.prefect)
        forked = self._fork(cmd, proc.name) if self.forking else None
        proc.popen = forked or self._popen(cmd, proc.name, subprocess.DEVNULL)
        proc.started_at = asked
        self.events.emit("start", t=asked, role=proc.role, learner=proc.name, pid=proc.popen.pid,
                         restarts=proc.restarts, forked=forked is not None, start_s=round(time.time() - asked, 4))

    # ---- warm standbys -------------------------------------------------------------------
    def spawn_standby(self, proc: Proc) -> None:
        """Start the learner's warm spare: it imports everything, then blocks on its stdin."""
        cmd = cli_command(proc.role, self.ctx, proc.name, self.prefect, standby=True)
        proc.standby = self._popen(cmd, proc.name, subprocess.PIPE)
        self.events.emit("standby", role="standby", learner=proc.name, pid=proc.standby.pid)

    def _activate_standby(self, proc: Proc) -> bool:
        """One line on the spare's stdin makes it the learner; False when there is no live spare."""
        spare, proc.standby = proc.standby, None
        if spare is None:
            return False
        try:
            spare.stdin.write(b"go\n")
            spare.stdin.close()
        except OSError:  # it died since the last tick: a broken pipe
            self._end_standby(proc.name, spare, "died")
            return False
        if spare.poll() is not None:
            self._end_standby(proc.name, spare, "died")
            return False
        proc.popen, proc.started_at = spare, time.time()
        self.events.emit("standby_end", role="standby", learner=proc.name, pid=spare.pid, how="activated")
        self.events.emit("start", role=proc.role, learner=proc.name, pid=spare.pid, restarts=proc.restarts,
                         standby=True)
        return True

    def _end_standby(self, name: str, spare: subprocess.Popen, how: str) -> None:
        """Kill (if needed) and reap a spare that will never be activated."""
        if spare.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(spare.pid, signal.SIGKILL)
            spare.wait(timeout=10)
        with contextlib.suppress(OSError):
            spare.stdin.close()
        self.events.emit("standby_end", role="standby", learner=name, pid=spare.pid, how=how,
                         code=spare.returncode)

    def keep_standbys(self, now: float) -> None:
        """Every learner still in the run has a live spare (one that died is respawned after a back-off)."""
        if not self.cfg.run.warm_standby or self.forking:
            return
        for proc in self.procs.values():
            if proc.role != "learner":
                continue
            if proc.standby is not None and (proc.removed or proc.standby.poll() is not None):
                self._end_standby(proc.name, proc.standby, "stopped" if proc.removed else "died")
                proc.standby, proc.standby_next = None, now + self.cfg.run.restart_backoff_s * 4
            if proc.standby is not None or proc.removed or now < proc.standby_next:
                continue
            if not proc.alive or now - proc.started_at >= JOIN_WAIT_S or self._joined(proc):
                self.spawn_standby(proc)

    def _joined(self, proc: Proc) -> bool:
        """Whether this learner process wrote its status (it does on join); read until it has, then remembered."""
        if proc.popen is None:
            return False
        if proc.joined_pid == proc.popen.pid:
            return True
        try:
            status = json.loads(self.ctx.store.get(self.ctx.keys.status(proc.name)))
        except (NotFound, StorageError, ValueError):
            return False
        if status.get("pid") != proc.popen.pid:
            return False
        proc.joined_pid = proc.popen.pid
        return True

    def stop_standbys(self) -> None:
        for proc in self.procs.values():
            if proc.standby is not None:
                self._end_standby(proc.name, proc.standby, "stopped")
                proc.standby = None

    def kill(self, name: str, sig: int = signal.SIGKILL, reason: str = "") -> None:
        proc = self.procs[name]
        if proc.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, sig)
            self.events.emit("kill", role=proc.role, learner=name, signal=int(sig), reason=reason)

    def restart_after(self, name: str, delay_s: float, reason: str = "") -> bool:
        """SIGKILL a process and start it again delay_s later; not counted toward max_restarts."""
        proc = self.procs[name]
        if not proc.alive:
            return False
        proc.planned_restart_at = time.time() + delay_s
        if proc.paused:
            self.resume(name)
        self.kill(name, signal.SIGKILL, reason=reason or "planned restart")
        return True

    def pause(self, name: str, reason: str = "") -> bool:
        """SIGSTOP a process (a straggler); heal() leaves it alone until resume()."""
        proc = self.procs[name]
        if not proc.alive or proc.paused:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGSTOP)
        proc.paused = True
        self.events.emit("pause", role=proc.role, learner=name, reason=reason)
        return True

    def resume(self, name: str) -> bool:
        proc = self.procs[name]
        if not proc.paused:
            return False
        proc.paused = False
        proc.resumed_at = time.time()
        if proc.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGCONT)
        self.events.emit("resume", role=proc.role, learner=name)
        return True

    def start_all(self) -> None:
        """Start the learners and the merger now; the evaluator once the learners joined (JOIN_WAIT_S)."""
        asked = time.time()  # the first fork waits for the zygote's imports: every role's start-up pays them
        for name in self.ctx.learners:
            self.spawn(self.add("learner", name), asked)
        self.spawn(self.add("merger", "merger"), asked)
        self.add("evaluator", "evaluator").deferred_until = time.time() + JOIN_WAIT_S

    def _start_deferred(self, now: float) -> None:
        waiting = [p for p in self.procs.values() if p.deferred_until is not None]
        if not waiting:
            return
        learners = [p for p in self.procs.values() if p.role == "learner" and not p.removed]
        if now < waiting[0].deferred_until and not all(self._joined(p) for p in learners):
            return
        for proc in waiting:
            proc.deferred_until = None
            self.spawn(proc)

    # ---- the watch loop ------------------------------------------------------------------
    def heal(self) -> None:
        """Restart exited or silent processes that should be running."""
        now = time.time()
        self._start_deferred(now)
        for proc in self.procs.values():
            if proc.removed or proc.paused or proc.deferred_until is not None:
                continue
            if proc.popen is not None and proc.popen.poll() is not None:
                code = proc.popen.returncode
                proc.exits.append(code)
                proc.popen = None
                self.events.emit("exit", role=proc.role, learner=proc.name, code=code)
                proc.next_start = now + self.cfg.run.restart_backoff_s * (2 ** min(proc.restarts, 5))
                if proc.planned_restart_at is not None:
                    proc.next_start = proc.planned_restart_at
            if proc.popen is None and proc.planned_restart_at is not None and now >= proc.next_start:
                self.events.emit("restart", role=proc.role, learner=proc.name, restarts=proc.restarts,
                                 planned=True)
                proc.planned_restart_at = None
                self.spawn(proc)
                continue
            if proc.restarts and proc.alive and now - proc.started_at > self.cfg.run.heartbeat_timeout_s:
                proc.restarts = 0  # up for a while: healthy again; max_restarts bounds crash loops, not a lifetime
            if proc.role == "learner" and proc.alive and self._silent(proc, now):
                self.kill(proc.name, reason="heartbeat stopped")
            if proc.popen is None and now >= proc.next_start:
                if proc.restarts >= self.cfg.run.max_restarts:
                    if not proc.removed:
                        log.error("%s exceeded max_restarts=%d; leaving it down", proc.name, self.cfg.run.max_restarts)
                        self.events.emit("give_up", role=proc.role, learner=proc.name)
                        proc.removed = True
                    continue
                proc.restarts += 1
                self.events.emit("restart", role=proc.role, learner=proc.name, restarts=proc.restarts)
                self.spawn(proc)
        self.keep_standbys(now)

    def _silent(self, proc: Proc, now: float) -> bool:
        timeout = self.cfg.run.heartbeat_timeout_s
        if now - max(proc.started_at, proc.resumed_at) < timeout:
            return False
        try:
            status = json.loads(self.ctx.store.get(self.ctx.keys.status(proc.name)))
            return now - float(status.get("t", 0)) > timeout
        except (NotFound, StorageError, ValueError):
            return False

    def latest(self) -> int:
        try:
            return latest_version(self.ctx.store, self.ctx.keys) or 0
        except StorageError:
            return -1

    def run_to_end(self, shutdown_grace_s: float = 60.0, **run_kwargs: object) -> str:
        """start_all, run, and always shut down (nothing of the run is left behind); returns why it ended."""
        self.start_all()
        reason = "error"
        try:
            reason = self.run(**run_kwargs)
        finally:
            self.shutdown(reason, grace_s=shutdown_grace_s)
        return reason

    def run(self, tick_s: float = 0.5, on_tick: Callable[[Supervisor], None] | None = None,
            until: Callable[[Supervisor], bool] | None = None) -> str:
        """Watch until the target version, a stop request (`diloco stop`), the time limit, or `until(self)`
        holds ("done": a test's own end condition, checked each tick); returns why it ended."""
        target, limit = self.cfg.run.num_versions, self.cfg.run.time_limit_s
        stop_requested = StopSignal(self.ctx, None)
        reason = "time limit"
        while time.time() - self.started_at < limit:
            if self.latest() >= target:
                reason = "target version"
                break
            if stop_requested():
                reason = "stop requested"  # the roles end their phase and exit; restarting them would be wrong
                break
            if until is not None and until(self):
                reason = "done"
                break
            for hook in self.hooks:
                hook(self)
            self.heal()
            if on_tick:
                on_tick(self)
            self.events.flush()
            time.sleep(tick_s)
        self.events.emit("end", reason=reason, version=self.latest())
        return reason

    def shutdown(self, reason: str, grace_s: float = 60.0) -> None:
        """Ask everyone to stop, wait for the final evaluation, then make sure nothing is left."""
        self.stop_standbys()  # idle spares: nothing to finish
        try:
            request_stop(self.ctx, reason)
        except StorageError as err:
            log.warning("could not write control/stop: %s", err)
        for proc in self.procs.values():
            if proc.paused:
                self.resume(proc.name)  # a stopped process cannot see control/stop
        deadline = time.time() + grace_s
        while time.time() < deadline and any(p.alive for p in self.procs.values()):
            time.sleep(0.2)
        for proc in self.procs.values():
            if proc.alive:
                self.kill(proc.name, signal.SIGKILL, reason="did not stop in time")
                proc.popen.wait(timeout=10)
        self.stop_standbys()
        if self.zygote is not None:
            self.zygote.close()
        self.events.emit("shutdown", reason=reason)
        self.events.flush()

"""The local backend of the supervisor: every role of a run as an OS process of this machine.

Contract: a role's process runs `python -m diloco.launch <role> ...` (or `python -m diloco.flows <role> ...`
as a Prefect flow run): with `run.start_method: fork` (the default, with or without Prefect; not on CUDA:
zygote.forks_roles) it is forked from a zygote (diloco.supervise.zygote_process), one process that paid the
imports once (prefect's and the flows' too when the roles are flow runs), so a (re)start is a fork and a join;
otherwise it is exec'd, with a warm standby per learner when `run.warm_standby` is on. Each process has its
own session (kill, SIGSTOP and SIGCONT reach its process group). A process's `start` event is stamped when the
start was asked for, so the zygote's imports at the first start count in the roles' start-up, as an exec's do.
`supervise_local` runs a whole run this way to its end (`diloco run`, diloco.api, the `train` flow's local
mode; no Prefect import here: a plain local run does not pay for it).

Warm standby (exec only): each learner has a spare process that has paid the imports and waits, blocked on
its stdin, without touching the bucket. A (re)start writes one line to the spare (it then opens the run,
builds the learner and joins the newest version) and a new spare is started once the learner joined.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.run.failure import LOG_ENV
from diloco.supervise.core import ENDED, JOIN_WAIT_S, RUNNING, Job, Supervisor
from diloco.supervise.failures import last_error_line
from diloco.supervise.zygote import Forked, Zygote, ZygoteError, forks_roles, take_early

log = logging.getLogger("diloco.supervisor")


def role_command(role: str, ctx: RunContext, name: str, prefect: bool, standby: bool = False) -> list[str]:
    """The command that runs one role of a run in its own process: the launch entry (diloco.launch), or the
    Prefect flow entry (diloco.flows); `--standby` makes it a learner's warm spare."""
    module = "diloco.flows" if prefect else "diloco.launch"
    argv = [role, "--storage", ctx.store.url, "--run-id", ctx.run_id, "--name", name]
    return [sys.executable, "-m", module, *argv, *(["--standby"] if standby else [])]


class ProcessBackend:
    """Roles as processes: forked from a zygote, activated warm spares, or exec'd."""

    defer_evaluator = True  # its imports would slow the learners' cold start on a shared machine

    def __init__(self, ctx: RunContext, events: EventLog, *, prefect: bool = False,
                 env: dict[str, str] | None = None, log_dir: str | None = None) -> None:
        self.ctx, self.cfg, self.events, self.prefect = ctx, ctx.cfg, events, prefect
        self.env = {**os.environ, **(env or {})}
        self.log_dir = log_dir
        self.kind = "prefect" if prefect else "local"  # recorded in the run's lease
        self.forking = forks_roles(self.cfg)  # with Prefect too: the zygote imports the flows
        self.standbys_on = self.cfg.run.warm_standby and not self.forking
        self.zygote: Zygote | None = None
        self.standbys: dict[str, subprocess.Popen] = {}  # learner -> its warm spare, blocked on its stdin
        self.standby_next: dict[str, float] = {}  # a spare that died is respawned, not before this time

    # ---- starting ------------------------------------------------------------------------------
    def _log_path(self, name: str) -> str | None:
        """Where a process of this name logs (the folder is made), or None without a log_dir."""
        if not self.log_dir:
            return None
        os.makedirs(self.log_dir, exist_ok=True)
        return os.path.join(self.log_dir, f"{name}.log")

    def _env_of(self, log_path: str | None) -> dict[str, str]:
        """The environment of a role's process: ours, and where its output goes (a failing learner records
        it)."""
        return {**self.env, LOG_ENV: os.path.abspath(log_path)} if log_path else self.env

    def failure_detail(self, job: Job) -> tuple[str | None, str | None]:
        """(the last error line of the job's log, the log's absolute path); (None, None) without a log_dir."""
        path = self._log_path(job.name)
        return (last_error_line(path), os.path.abspath(path)) if path else (None, None)

    def _popen(self, cmd: list[str], name: str, stdin: int) -> subprocess.Popen:
        log_path = self._log_path(name)
        if log_path is None:
            return subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                    stdin=stdin, start_new_session=True)
        with open(log_path, "ab") as out:  # the child keeps its own copy
            return subprocess.Popen(cmd, env=self._env_of(log_path), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=stdin, start_new_session=True)

    def _fork(self, argv: list[str], name: str) -> Forked | None:
        """Fork the role from the zygote (started on first use); None (and exec from now on) if it fails."""
        try:
            if self.zygote is None:
                self.zygote = take_early(self.ctx.run_id, self.prefect) or Zygote(
                    self.env, f"--run-id={self.ctx.run_id}", self._log_path("zygote"), flows=self.prefect)
            log_path = self._log_path(name)
            return self.zygote.spawn(argv, log_path, self._env_of(log_path), name)
        except (ZygoteError, OSError) as err:
            log.warning("zygote unavailable (%s): starting processes with exec from now on", err)
            self.events.emit("zygote_failed", reason=str(err))
            self.forking = False
            return None

    def start(self, job: Job, asked: float) -> str | None:
        """Forked from the zygote, or a live warm spare (learners), or exec'd; never refused."""
        if job.role == "learner" and self._activate_standby(job):
            return None
        cmd = role_command(job.role, self.ctx, job.name, self.prefect)
        forked = self._fork(cmd[3:], job.name) if self.forking else None
        job.handle = forked or self._popen(cmd, job.name, subprocess.DEVNULL)
        job.history.append(str(job.handle.pid))
        self.events.emit("start", t=asked, role=job.role, learner=job.name, pid=job.handle.pid,
                         restarts=job.restarts, forked=forked is not None,
                         start_s=round(time.time() - asked, 4))
        return None

    # ---- watching and ending ---------------------------------------------------------------------
    def state(self, job: Job) -> tuple[str, object]:
        code = job.handle.poll()
        return (RUNNING, None) if code is None else (ENDED, code)

    def kill(self, job: Job, reason: str) -> None:
        """SIGKILL the process group and reap it (its next state() is ENDED)."""
        proc = job.handle
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            self.events.emit("kill", role=job.role, learner=job.name, signal=int(signal.SIGKILL),
                             reason=reason)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def _signal(self, job: Job, sig: int) -> bool:
        try:
            os.killpg(job.handle.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def pause(self, job: Job) -> bool:
        return self._signal(job, signal.SIGSTOP)

    def resume(self, job: Job) -> bool:
        return self._signal(job, signal.SIGCONT)

    def close(self) -> None:
        self.stop_standbys()
        if self.zygote is not None:
            self.zygote.close()

    # ---- warm standbys ---------------------------------------------------------------------------
    def spawn_standby(self, job: Job) -> None:
        """Start the learner's warm spare: it imports everything, then blocks on its stdin."""
        cmd = role_command(job.role, self.ctx, job.name, self.prefect, standby=True)
        spare = self._popen(cmd, job.name, subprocess.PIPE)
        self.standbys[job.name] = spare
        self.events.emit("standby", role="standby", learner=job.name, pid=spare.pid)

    def _activate_standby(self, job: Job) -> bool:
        """One line on the spare's stdin makes it the learner; False when there is no live spare."""
        spare = self.standbys.pop(job.name, None)
        if spare is None:
            return False
        try:
            spare.stdin.write(b"go\n")
            spare.stdin.close()
        except OSError:  # it died since the last tick: a broken pipe
            self._end_standby(job.name, spare, "died")
            return False
        if spare.poll() is not None:
            self._end_standby(job.name, spare, "died")
            return False
        job.handle = spare
        job.history.append(str(spare.pid))
        self.events.emit("standby_end", role="standby", learner=job.name, pid=spare.pid, how="activated")
        self.events.emit("start", role=job.role, learner=job.name, pid=spare.pid, restarts=job.restarts,
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

    def tick(self, sup: Supervisor, now: float) -> None:
        """Every learner still in the run has a live spare (one that died is respawned after a back-off),
        started once the learner joined (warming it earlier competes with the learner's own start)."""
        if not self.standbys_on:
            return
        for job in sup.jobs.values():
            if job.role != "learner":
                continue
            spare = self.standbys.get(job.name)
            if spare is not None and (job.removed or spare.poll() is not None):
                self._end_standby(job.name, self.standbys.pop(job.name), "stopped" if job.removed else "died")
                self.standby_next[job.name] = now + self.cfg.run.restart_backoff_s * 4
                spare = None
            if spare is not None or job.removed or now < self.standby_next.get(job.name, 0.0):
                continue
            if job.handle is None or now - job.started_at >= JOIN_WAIT_S or sup.joined(job):
                self.spawn_standby(job)

    def stop_standbys(self) -> None:
        for name in list(self.standbys):
            self._end_standby(name, self.standbys.pop(name), "stopped")


def local_supervisor(ctx: RunContext, *, prefect: bool = False, events: EventLog | None = None,
                     env: dict[str, str] | None = None, log_dir: str | None = None) -> Supervisor:
    """A supervisor of the run's roles as processes of this machine (`diloco run`, the `train` flow's local
    mode)."""
    events = events or EventLog(ctx.store, ctx.keys, "supervisor")
    backend = ProcessBackend(ctx, events, prefect=prefect, env=env, log_dir=log_dir)
    return Supervisor(ctx, backend, events=events)


def supervise_local(ctx: RunContext, *, prefect: bool, log_dir: str | None,
                    attach: Callable[[Supervisor], object] | None = None,
                    on_tick: Callable[[Any], None] | None = None, env: dict[str, str] | None = None) -> str:
    """Start every role (with `env` added to their environment), heal, stop at the end, shut down; returns why
    the run ended. `attach` gets the supervisor before it starts: a chaos plan's agent, which the caller
    brings (diloco.chaos.agent.attach_chaos: a leaf the core never imports)."""
    supervisor = local_supervisor(ctx, prefect=prefect, log_dir=log_dir, env=env)
    if attach is not None:
        attach(supervisor)
    return supervisor.run_to_end(on_tick=on_tick)

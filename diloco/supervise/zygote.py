"""The supervisor's handle on a zygote (the program is supervise/zygote_process.py): start it, fork roles from
it, close it.

Contract: `Zygote` starts `python -m diloco.supervise.zygote_process`, which imports torch and every role's
code and runs a throwaway training step (launch.warm_up), then forks on request.
A forked child starts its own session (a process group the supervisor can SIGKILL or SIGSTOP),
points stdin at /dev/null and stdout/stderr at its log, takes the environment it was given, and
runs the launch entry (diloco.launch) with the given arguments; it is a warm process from its first
instruction, so a (re)start costs a fork and the join, not seconds of imports. The zygote reaps
its children and reports each exit code; `Forked` gives the supervisor Popen's interface (pid,
poll, wait, returncode). The zygote exits when the supervisor closes its stdin or goes away;
children are never killed by it. Protocol: JSON lines; requests on the zygote's stdin, replies
("ready", {"pid"}, {"exit", "code"}, {"error"}) on its stdout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diloco.configs import Config

log = logging.getLogger("diloco.zygote")
READY_TIMEOUT_S = 120.0  # imports on a loaded machine; the supervisor falls back to exec after this


def forks_roles(cfg: Config) -> bool:
    """Whether a local run's roles are forked from a zygote: `run.start_method: fork`, unless they train or
    score on CUDA (a process forked after torch looked for a GPU cannot use it: "Cannot re-initialize CUDA in
    forked subprocess", seen on an H200), where each role is exec'd instead."""
    if cfg.run.start_method != "fork":
        return False
    from diloco.training.inner import uses_cuda

    if uses_cuda(cfg.learner.device):
        log.info("roles on CUDA: each is started as a fresh process (CUDA cannot be used in a forked child)")
        return False
    return True


class ZygoteError(RuntimeError):
    """The zygote is gone or did not answer: the caller starts the process the plain way."""


class Forked:
    """A process forked by the zygote, seen through Popen's interface (it is not our child)."""

    stdin = None

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


class Zygote:
    """The supervisor's handle: start it, fork roles from it, close it."""

    def __init__(self, env: dict[str, str], label: str, log_path: str | None = None,
                 flows: bool = False) -> None:
        """`label` shows in `ps` (the run id); the zygote's own stderr goes to `log_path` (else nowhere);
        `flows`: it also imports prefect and the flows, to fork roles as Prefect flow runs."""
        self.flows = flows
        # the child keeps a copy of the log file
        err = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "diloco.supervise.zygote_process", label,
                 *(["--flows"] if flows else [])],
                env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, start_new_session=True,
            )
        finally:
            if log_path:
                err.close()
        self._cond = threading.Condition()
        self._ready = False
        self._replies: list[dict] = []
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()  # one request at a time: replies come back in order
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            with self._cond:
                if msg == "ready":
                    self._ready = True
                elif isinstance(msg, dict) and "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["code"])
                else:
                    self._replies.append(msg)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: list[str], log_path: str | None, env: dict[str, str], name: str) -> Forked:
        """Fork the role `argv` (the launch protocol; as a flow run if this zygote has the flows), waiting for
        the zygote's imports the first time; ZygoteError if it cannot."""
        request = json.dumps({"argv": argv, "log": log_path, "env": env, "name": name,
                              "entry": "flows" if self.flows else "launch"}) + "\n"
        with self._lock, self._cond:
            if not self._cond.wait_for(lambda: self._ready or not self.alive, timeout=READY_TIMEOUT_S) \
                    or not self.alive:
                raise ZygoteError("the zygote is not running")
            try:
                self.proc.stdin.write(request.encode())
                self.proc.stdin.flush()
            except OSError as err:
                raise ZygoteError(f"the zygote is gone: {err}") from None
            if (not self._cond.wait_for(lambda: self._replies or not self.alive, timeout=30.0)
                    or not self._replies):
                raise ZygoteError("the zygote did not answer")
            reply = self._replies.pop(0)
        if "pid" not in reply:
            raise ZygoteError(f"the zygote could not fork: {reply.get('error')}")
        return Forked(self, int(reply["pid"]))

    def exit_code(self, pid: int) -> int | None:
        """The exit code the zygote reported, None while running; if the zygote itself is gone, a
        child that no longer exists counts as exited with code 1 (its real code is lost)."""
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
        if self.alive:
            return None
        from diloco.run.lease import pid_alive  # the supervisor has the run's modules loaded by now

        return None if pid_alive(pid) else 1

    def close(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._reader.join(timeout=5)


# ---- a zygote started before its supervisor ------------------------------------------------------
_EARLY: dict[str, Zygote] = {}  # run id -> a zygote started while the Prefect server boots, not yet taken


def start_early(run_id: str, env: dict[str, str], log_path: str | None, flows: bool) -> None:
    """Start the run's zygote now, so its imports overlap whatever comes before the supervisor (the local
    Prefect server's start); the supervisor's backend takes it (take_early) instead of starting its own."""
    if run_id not in _EARLY:
        _EARLY[run_id] = Zygote(env, f"--run-id={run_id}", log_path, flows=flows)


def take_early(run_id: str, flows: bool) -> Zygote | None:
    """The early zygote of the run, if one was started with the same kind of roles and still lives."""
    zygote = _EARLY.pop(run_id, None)
    if zygote is not None and (zygote.flows != flows or not zygote.alive):
        zygote.close()
        return None
    return zygote


def close_early(run_id: str) -> None:
    """Close an early zygote nobody took (the run ended before its supervisor started)."""
    zygote = _EARLY.pop(run_id, None)
    if zygote is not None:
        zygote.close()

"""The supervisor's lease on a run: one live supervisor at a time, and a heartbeat the roles can watch.

Contract: `acquire` creates the next epoch (control/lease-<epoch>) by exclusive create, and refuses with
LeaseHeld while the current lease is live (renewed within its timeout_s; on the same host, its pid alive),
so two `diloco run` of the same run cannot both supervise it; `Lease.renew` rewrites it every RENEW_EVERY_S
and notices a newer epoch (another supervisor took over: `lost`); `release` marks the session ended. The
bucket is the only channel: no ports, no pid files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid

from diloco.run.context import RunContext, RunError
from diloco.storage import Conflict, StorageError
from diloco.storage.keys import parse_lease_key
from diloco.storage.records import RecordError, SupervisorLease, read_record, write_record
from diloco.storage.store import Store

log = logging.getLogger("diloco.lease")
RENEW_EVERY_S = 2.0  # a renewal is one small PUT (and one listing to notice a takeover)


class LeaseHeld(RunError):
    """Another supervisor holds a live lease on the run (a user error: one line, exit 2)."""


def read_current(store: Store, run_keys) -> SupervisorLease | None:
    """The lease of the highest epoch, or None when the run was never supervised (unreadable ones skipped)."""
    epochs = sorted((e for e in (parse_lease_key(k) for k in store.list(run_keys.leases_prefix())) if e),
                    reverse=True)
    for epoch in epochs:
        try:
            return read_record(store, run_keys.lease(epoch), SupervisorLease)
        except (RecordError, StorageError):
            continue
    return None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` (not necessarily our child) still runs; a zombie nobody reaped has ended."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def is_live(lease: SupervisorLease | None, now: float | None = None) -> bool:
    """Whether the lease's supervisor still supervises: not released, renewed within timeout_s (its clock
    against ours), and — on this host — its process alive."""
    if lease is None or lease.released:
        return False
    now = time.time() if now is None else now
    if now - lease.t > lease.timeout_s:
        return False
    return lease.host != socket.gethostname() or pid_alive(lease.pid)


def describe(lease: SupervisorLease, now: float | None = None) -> str:
    """`pid 123 on host h (local, since 12:00:01, renewed 2 s ago)`."""
    now = time.time() if now is None else now
    since = time.strftime("%H:%M:%S", time.localtime(lease.started_at))
    return (f"pid {lease.pid} on host {lease.host} ({lease.kind}, since {since}, renewed "
            f"{now - lease.t:.0f} s ago)")


class Lease:
    """This process's lease on a run: renew it while supervising, release it at the end."""

    def __init__(self, ctx: RunContext, record: SupervisorLease) -> None:
        self.ctx, self.record = ctx, record
        self.store = ctx.store.with_retries(1)  # renewed often: an outage must not stall the watch loop
        self.lost: str | None = None  # why this session no longer holds the run
        self._renewed = time.monotonic()

    @property
    def key(self) -> str:
        return self.ctx.keys.lease(self.record.epoch)

    def renew(self, force: bool = False) -> bool:
        """Rewrite the lease (at most every RENEW_EVERY_S unless forced); False once it is lost."""
        if self.lost:
            return False
        if not force and time.monotonic() - self._renewed < RENEW_EVERY_S:
            return True
        try:
            current = read_current(self.store, self.ctx.keys)
            if current is not None and current.epoch > self.record.epoch:
                self.lost = f"supervisor {describe(current)} took over the run (lease epoch {current.epoch})"
                return False
            self.record = self.record.model_copy(update={"t": time.time(), "beat": self.record.beat + 1})
            write_record(self.store, self.key, self.record)
            self._renewed = time.monotonic()
        except StorageError as err:
            log.warning("run %s: lease not renewed (%s); trying again", self.ctx.run_id, err)
        return True

    def release(self, reason: str) -> None:
        """Mark the session ended (roles then no longer watch it); storage trouble is logged, not raised."""
        if self.lost:
            return
        self.record = self.record.model_copy(update={"t": time.time(), "released": True,
                                                     "end_reason": reason})
        try:
            write_record(self.ctx.store, self.key, self.record)
        except StorageError as err:
            log.warning("run %s: lease not released (%s)", self.ctx.run_id, err)


def acquire(ctx: RunContext, kind: str, now: float | None = None) -> Lease:
    """Take the run for this supervisor session, or LeaseHeld naming the live supervisor."""
    now = time.time() if now is None else now
    current = read_current(ctx.store, ctx.keys)
    if is_live(current, now):
        raise LeaseHeld(_held_message(ctx, current, now))
    record = SupervisorLease(epoch=(current.epoch + 1) if current else 1, owner=uuid.uuid4().hex,
                             host=socket.gethostname(), pid=os.getpid(), kind=kind, started_at=now, t=now,
                             timeout_s=ctx.cfg.run.heartbeat_timeout_s,
                             deadline=now + ctx.cfg.run.time_limit_s)
    try:
        write_record(ctx.store, ctx.keys.lease(record.epoch), record, exclusive=True)
    except Conflict:
        winner = None
        with contextlib.suppress(StorageError):
            winner = read_current(ctx.store, ctx.keys)
        raise LeaseHeld(_held_message(ctx, winner, now) if winner else
                        f"run {ctx.run_id!r} was just taken by another supervisor") from None
    return Lease(ctx, record)


def held_error(ctx: RunContext, lease: SupervisorLease) -> LeaseHeld:
    """The error that refuses a second supervisor of a live run."""
    return LeaseHeld(_held_message(ctx, lease, time.time()))


def _held_message(ctx: RunContext, lease: SupervisorLease, now: float) -> str:
    return (f"run {ctx.run_id!r} is already supervised by {describe(lease, now)}; watch it with "
            f"`diloco status --run-id {ctx.run_id} --storage {ctx.store.url}` or end it with `diloco stop`")

"""SIGINT and SIGTERM while a run is supervised: the first asks for an orderly end, the second hurries it.

Contract: inside `catch_signals()` (main thread only; elsewhere it does nothing) SIGINT and SIGTERM are
recorded instead of killing the process: `received()` names the first ("interrupted" for SIGINT,
"terminated" for SIGTERM, with the exit code 130 / 143 a shell expects) and the watch loop ends the run
with that reason; a second signal makes the shutdown kill what is left at once; a third raises
KeyboardInterrupt (the user insists). Signal handlers are process-wide, so the record is one per process:
the outermost scope clears it, nested scopes (the CLI around the `train` flow around the supervisor, each
re-installing after Prefect's own SIGTERM handler) share it, and each scope restores what it replaced.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

REASONS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


@dataclass(frozen=True)
class Interrupt:
    signal: int
    reason: str  # "interrupted" | "terminated": the stop reason recorded in control/stop
    exit_code: int  # 128 + the signal number: 130 for SIGINT, 143 for SIGTERM


class _Record:
    """The signals this process received while a scope was active (process-wide, like the handlers)."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.depth = 0


_RECORD = _Record()


def _handle(signum: int, _frame: FrameType | None) -> None:
    _RECORD.signals.append(signum)
    if len(_RECORD.signals) >= 3:
        raise KeyboardInterrupt


def received() -> Interrupt | None:
    """The first signal caught in the current scope, or None."""
    if not _RECORD.signals:
        return None
    first = _RECORD.signals[0]
    return Interrupt(first, REASONS.get(first, "terminated"), 128 + first)


def hurried() -> bool:
    """A second signal arrived: end what is left now, without the grace period."""
    return len(_RECORD.signals) >= 2


def reason_of(exit_reason: str) -> Interrupt | None:
    """The Interrupt a run's end reason stands for ("interrupted" / "terminated"), else None."""
    for signum, reason in REASONS.items():
        if exit_reason == reason:
            return Interrupt(signum, reason, 128 + signum)
    return None


@contextlib.contextmanager
def catch_signals() -> Iterator[None]:
    """Record SIGINT/SIGTERM instead of dying, for the duration (see the module's contract)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _RECORD.depth == 0:
        _RECORD.signals.clear()
    previous = {sig: signal.signal(sig, _handle) for sig in REASONS}
    _RECORD.depth += 1
    try:
        yield
    finally:
        _RECORD.depth -= 1
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python

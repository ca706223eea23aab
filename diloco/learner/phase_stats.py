"""The figures of one learner phase: steps, tokens, loss, and where its wall time went (the `phase` event's
breakdown; the summary's `busy` is compute_s over the phase's duration).

Contract: a plain record the phase fills in; `timed(part)` adds a block's time to one of its parts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class PhaseStats:
    seq: int = -1
    steps: int = 0
    tokens: int = 0
    loss: float = float("nan")
    phase_time_s: float = 0.0
    stall_s: float = 0.0
    installs: list[int] = field(default_factory=list)
    delta_bytes: int = 0
    compute_s: float = 0.0  # of phase_time_s: in inner steps (train_step), ...
    install_s: float = 0.0  # ... installing merged versions (carry, and a fetch without a prefetcher) ...
    ship_s: float = 0.0  # ... shipping fragments (delta, encode, error feedback) ...
    save_s: float = 0.0  # ... and taking the local state's snapshots; the rest is the loop's own

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the time the block takes to `part` (compute_s, install_s, ship_s or save_s)."""
        start = time.time()
        try:
            yield
        finally:
            setattr(self, part, getattr(self, part) + time.time() - start)

    def times(self) -> dict[str, float]:
        """The phase event's breakdown of its duration_s (the summary's `busy` is compute_s over it)."""
        return {"compute_s": round(self.compute_s, 4), "install_s": round(self.install_s, 4),
                "ship_s": round(self.ship_s, 4), "save_s": round(self.save_s, 4)}

"""The simulator's assumptions: one typed, validated set of failure and recovery times for every cell.

Contract: `SimConfig` is immutable; a bad field raises ValueError naming it; derived figures are pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

SECONDS_PER_YEAR = 365.0 * 86400.0


@dataclass(frozen=True)
class SimConfig:
    """Every assumption of the goodput model (the defaults are the ones that reproduce Table 1).

    Times are wall-clock seconds. The recovery times were chosen by reasoning about the order of
    magnitude, then ONE coarse global fit over all 30 cells of Table 1 (docs/SIMULATOR.md).
    """

    mtbf_chip_s: float = SECONDS_PER_YEAR  # paper: 1 year per chip -> 26 s for the cluster at 1.2M chips
    detect_s: float = 10.0  # heartbeat / collective timeout before anyone acts on a dead chip
    restart_s: float = 53.0  # data-parallel: tear down, reschedule on a spare, reload, recompile (cached)
    checkpoint_write_s: float = 2.0  # blocking snapshot to host RAM; Young-Daly sets the interval from it
    reshard_s: float = 10.0  # elastic: rebuild the mesh without the dead replica, recompile, resume
    rejoin_s: float = 14.0  # elastic scale-up: re-shard plus copying weights and optimizer state to it
    scaleup_wait_s: float = 100.0  # a repaired replica rides the next re-shard, or forces one after this
    repair_s: float = 600.0  # swap in a hot-spare host and health-check it before its replica returns
    chips_per_replica: int = 256  # one data-parallel replica (an ICI slice): the unit an elastic job drops
    learner_speed_cv: float = 0.10  # per-round spread of learner speed (the paper's heterogeneous runs: 10%)
    quorum: int = 1  # learners the syncer waits for; K=1 (+ grace) never blocks a learner
    num_failures: int = 50_000  # Monte Carlo size: expected failures per cell (SE ~0.1 goodput points)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or math.isnan(value) or value < 0:
                raise ValueError(f"SimConfig.{f.name} must be a number >= 0, got {value!r}")
        if self.mtbf_chip_s <= 0:
            raise ValueError(
                f"SimConfig.mtbf_chip_s must be > 0 (math.inf for no failures), got {self.mtbf_chip_s}"
            )
        if self.chips_per_replica < 1 or self.quorum < 1 or self.num_failures < 1:
            raise ValueError("SimConfig.chips_per_replica, quorum and num_failures must be >= 1")

    def with_(self, **changes: float) -> SimConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def scaled_recovery(self, factor: float) -> SimConfig:
        """Every recovery time (detection, restart, re-shard, rejoin) multiplied by `factor`."""
        if factor < 0:
            raise ValueError(f"recovery scale factor must be >= 0, got {factor}")
        return replace(
            self,
            detect_s=self.detect_s * factor,
            restart_s=self.restart_s * factor,
            reshard_s=self.reshard_s * factor,
            rejoin_s=self.rejoin_s * factor,
        )


def cluster_mtbf_s(cfg: SimConfig, num_chips: float) -> float:
    """Mean time between failures of any chip among `num_chips` (independent exponential chips)."""
    return cfg.mtbf_chip_s / num_chips


def young_daly_interval_s(cfg: SimConfig, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints, sqrt(2 * write time * MTBF)."""
    return math.sqrt(2.0 * cfg.checkpoint_write_s * mtbf_s)


def horizon_s(cfg: SimConfig, num_chips: float) -> float:
    """Wall-clock horizon giving about `num_failures` failures over the whole cluster."""
    return cfg.num_failures * cluster_mtbf_s(cfg, num_chips)

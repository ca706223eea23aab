"""Monte Carlo of failures for data-parallel, elastic data-parallel and Decoupled DiLoCo (numpy only).

Contract: each `simulate_*` returns goodput in [0, 1] = useful chip-seconds that reach the final model
÷ provisioned chip-seconds; deterministic for a given seed; no failures (mtbf = inf) gives exactly 1.
Failures are drawn on the progress clock (Young's first-order model): chips fail while the job
do new work; checkpoint writes, recoveries and replays are failure-free (a failure then is handled
by the recovery already under way).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from diloco.sim.model import SimConfig, cluster_mtbf_s, horizon_s, young_daly_interval_s

STRATEGIES = ("dp", "elastic_dp", "m2", "m4", "m8", "m16")


def _restart_island(num_chips: float, cfg: SimConfig, horizon: float, rng: np.random.Generator) -> float:
    """Useful chip-seconds of a job that stops entirely on any failure and rolls back to a checkpoint.

    Renewal cycles on the progress clock: Exp(MTBF) of new work, then detection + restart + replay
    of the work since the last checkpoint; a blocking write every Young-Daly interval. Scaled to `horizon`.
    """
    mtbf = cluster_mtbf_s(cfg, num_chips)
    if math.isinf(mtbf):
        return num_chips * horizon
    num_cycles = max(1, math.ceil(horizon / mtbf))
    new_work_s = np.cumsum(rng.exponential(mtbf, num_cycles))  # progress clock at each failure
    total_new = float(new_work_s[-1])
    if cfg.checkpoint_write_s > 0:
        interval = young_daly_interval_s(cfg, mtbf)
        replay_s = float(np.sum(new_work_s % interval))  # work since the last checkpoint
        writes_s = total_new / interval * cfg.checkpoint_write_s
    else:
        replay_s = writes_s = 0.0  # free continuous checkpoints: nothing to replay
    wall = total_new + writes_s + num_cycles * (cfg.detect_s + cfg.restart_s) + replay_s
    return num_chips * horizon * total_new / wall


def _elastic_island(num_chips: float, cfg: SimConfig, horizon: float, rng: np.random.Generator) -> float:
    """Useful chip-seconds of an elastic job that drops a failed replica and keeps going.

    A failure pauses the job for detection + re-shard and removes one replica until it is repaired;
    a repaired replica joins at the next re-shard, or forces a scale-up pause after `scaleup_wait_s`.
    """
    num_replicas = max(1, round(num_chips / cfg.chips_per_replica))
    rate_per_replica = num_chips / num_replicas / cfg.mtbf_chip_s
    if rate_per_replica == 0:
        return num_chips * horizon
    unit_gaps = iter(rng.exponential(1.0, int(horizon * num_chips / cfg.mtbf_chip_s * 1.5) + 64))
    repaired_at: deque[float] = deque()  # wall time each down replica is healthy again (FIFO)
    t = useful_replica_s = 0.0
    active = num_replicas
    while t < horizon:
        gap = next(unit_gaps, None)
        if gap is None:
            gap = float(rng.exponential(1.0))
        gap = gap / (active * rate_per_replica) if active else math.inf
        deadline = repaired_at[0] + cfg.scaleup_wait_s - t if repaired_at else math.inf
        run = min(gap, max(deadline, 0.0), horizon - t)
        useful_replica_s += run * active
        t += run
        if t >= horizon:
            break
        if run == gap:  # a chip failed: its replica leaves; the survivors re-shard
            active -= 1
            repaired_at.append(t + cfg.repair_s)
            pause = cfg.detect_s + cfg.reshard_s
        else:  # a repaired replica waited long enough: dedicated scale-up
            pause = cfg.rejoin_s
        while repaired_at and repaired_at[0] <= t:  # the re-shard admits every healthy replica
            repaired_at.popleft()
            active += 1
        t += pause
    return useful_replica_s * num_chips / num_replicas


def quorum_efficiency(
    num_learners: int, quorum: int, speed_cv: float, rng: np.random.Generator, num_rounds: int = 2000
) -> float:
    """Fraction of learner time spent computing when the first `quorum` arrivals block on the merge.

    Each round every learner takes lognormal(0, cv) time; the round closes at the quorum-th arrival;
    learners already there idle until it closes, later ones are merged next round and never wait.
    K=1 gives exactly 1; K=M is fully synchronous (everyone waits for the slowest).
    """
    if not 1 <= quorum <= num_learners:
        raise ValueError(f"quorum must be in [1, {num_learners}], got {quorum}")
    times = rng.lognormal(0.0, speed_cv, (num_rounds, num_learners))  # (rounds, M)
    close = np.sort(times, axis=1)[:, quorum - 1 : quorum]  # (rounds, 1)
    busy = times.sum()
    return float(busy / np.where(times <= close, close, times).sum())


def simulate_dp(num_chips: float, cfg: SimConfig, seed: int = 0) -> float:
    """Goodput of synchronous data-parallel: any failure stalls every chip, then rollback."""
    horizon = _horizon(cfg, num_chips)
    return _restart_island(num_chips, cfg, horizon, np.random.default_rng(seed)) / (num_chips * horizon)


def simulate_elastic_dp(num_chips: float, cfg: SimConfig, seed: int = 0) -> float:
    """Goodput of elastic data-parallel: drop the failed replica, re-shard, scale back up later."""
    horizon = _horizon(cfg, num_chips)
    return _elastic_island(num_chips, cfg, horizon, np.random.default_rng(seed)) / (num_chips * horizon)


def simulate_decoupled(
    num_chips: float, num_learners: int, cfg: SimConfig, seed: int = 0, learner_recovery: str = "elastic"
) -> float:
    """Goodput of Decoupled DiLoCo: M independent learners of num_chips/M chips, and a syncer.

    A failure touches one learner only. `learner_recovery="elastic"` (the paper: a learner that lost
    slices keeps going with fewer tokens per step) or `"restart"` (the whole learner restarts like a
    data-parallel job; M=1 is then exactly data-parallel).
    """
    if num_learners < 1:
        raise ValueError(f"num_learners must be >= 1, got {num_learners}")
    islands = {"elastic": _elastic_island, "restart": _restart_island}
    if learner_recovery not in islands:
        raise ValueError(f"learner_recovery must be one of {sorted(islands)}, got {learner_recovery!r}")
    horizon = _horizon(cfg, num_chips)
    rng = np.random.default_rng(seed)
    island_chips = num_chips / num_learners
    useful = sum(islands[learner_recovery](island_chips, cfg, horizon, rng) for _ in range(num_learners))
    quorum = min(cfg.quorum, num_learners)
    efficiency = quorum_efficiency(num_learners, quorum, cfg.learner_speed_cv, rng) if quorum > 1 else 1.0
    return useful * efficiency / (num_chips * horizon)


def simulate_strategy(strategy: str, num_chips: float, cfg: SimConfig, seed: int = 0) -> float:
    """Goodput of one named strategy: "dp", "elastic_dp" or "m<M>" (Decoupled DiLoCo, M learners)."""
    if strategy == "dp":
        return simulate_dp(num_chips, cfg, seed)
    if strategy == "elastic_dp":
        return simulate_elastic_dp(num_chips, cfg, seed)
    if strategy.startswith("m") and strategy[1:].isdigit():
        return simulate_decoupled(num_chips, int(strategy[1:]), cfg, seed)
    raise ValueError(f"strategy must be 'dp', 'elastic_dp' or 'm<learners>', got {strategy!r}")


def _horizon(cfg: SimConfig, num_chips: float) -> float:
    if num_chips <= 0:
        raise ValueError(f"num_chips must be > 0, got {num_chips}")
    return horizon_s(cfg, num_chips) if math.isfinite(cfg.mtbf_chip_s) else 1.0

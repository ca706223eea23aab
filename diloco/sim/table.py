"""The goodput table (the paper's Table 1 grid), its comparison with the paper, and the sweeps.

Contract: pure functions of (SimConfig, seed); every cell gets its own seed derived from the base seed,
so a cell's value does not depend on which other cells were run.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import numpy as np

from diloco.sim.model import SECONDS_PER_YEAR, SimConfig, cluster_mtbf_s, young_daly_interval_s
from diloco.sim.strategies import STRATEGIES, simulate_strategy

CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
# Decoupled DiLoCo (arXiv 2604.21428) Table 1, goodput % per strategy at CHIPS.
PAPER_TABLE: dict[str, tuple[int, ...]] = {
    "dp": (72, 57, 38, 27, 18),
    "elastic_dp": (88, 80, 69, 58, 40),
    "m2": (94, 88, 80, 70, 54),
    "m4": (96, 93, 89, 82, 73),
    "m8": (98, 96, 94, 88, 80),
    "m16": (99, 98, 96, 93, 86),
}
LABELS = {
    "dp": "data-parallel",
    "elastic_dp": "elastic data-parallel",
    "m2": "Decoupled DiLoCo M=2",
    "m4": "Decoupled DiLoCo M=4",
    "m8": "Decoupled DiLoCo M=8",
    "m16": "Decoupled DiLoCo M=16",
}
SWEEP_CHIPS = 1_200_000
SWEEP_MTBF_YEARS = (0.25, 0.5, 1.0, 2.0, 4.0)
SWEEP_RECOVERY_SCALE = (0.25, 0.5, 1.0, 2.0, 4.0)


def cell_seed(seed: int, strategy: str, num_chips: int) -> int:
    """A reproducible seed per (base seed, strategy, chip count) cell."""
    return int(np.random.SeedSequence([seed, STRATEGIES.index(strategy), num_chips]).generate_state(1)[0])


def run_table(cfg: SimConfig, seed: int = 0, chips: tuple[int, ...] = CHIPS) -> dict[str, list[float]]:
    """Goodput (fraction 0..1) of every strategy at every chip count."""
    return {
        strategy: [simulate_strategy(strategy, n, cfg, cell_seed(seed, strategy, n)) for n in chips]
        for strategy in STRATEGIES
    }


def max_abs_error_points(goodput: dict[str, list[float]]) -> float:
    """Largest |simulated - paper| over all cells, in goodput points (the table must be at CHIPS)."""
    return max(
        abs(100.0 * g - p) for s in STRATEGIES for g, p in zip(goodput[s], PAPER_TABLE[s], strict=True)
    )


def sweep_mtbf(cfg: SimConfig, seed: int = 0, years: tuple[float, ...] = SWEEP_MTBF_YEARS) -> dict[str, Any]:
    """Goodput at SWEEP_CHIPS chips against per-chip MTBF (years); other assumptions unchanged."""
    rows = {s: [] for s in STRATEGIES}
    for y in years:
        varied = cfg.with_(mtbf_chip_s=y * SECONDS_PER_YEAR)
        for s in STRATEGIES:
            rows[s].append(
                round(simulate_strategy(s, SWEEP_CHIPS, varied, cell_seed(seed, s, SWEEP_CHIPS)), 4)
            )
    return {"chips": SWEEP_CHIPS, "mtbf_years": list(years), "goodput": rows}


def sweep_recovery(
    cfg: SimConfig, seed: int = 0, scales: tuple[float, ...] = SWEEP_RECOVERY_SCALE
) -> dict[str, Any]:
    """Goodput at SWEEP_CHIPS chips with every recovery time (detect, restart, re-shard, rejoin) × scale."""
    rows = {s: [] for s in STRATEGIES}
    for k in scales:
        varied = cfg.scaled_recovery(k)
        for s in STRATEGIES:
            rows[s].append(
                round(simulate_strategy(s, SWEEP_CHIPS, varied, cell_seed(seed, s, SWEEP_CHIPS)), 4)
            )
    return {
        "chips": SWEEP_CHIPS,
        "recovery_scale": list(scales),
        "dp_detect_plus_restart_s": [k * (cfg.detect_s + cfg.restart_s) for k in scales],
        "goodput": rows,
    }


def assumptions(cfg: SimConfig) -> dict[str, Any]:
    """The config plus derived figures worth stating (cluster MTBF, Young-Daly interval) per chip count."""
    derived = {
        str(n): {
            "cluster_mtbf_s": round(cluster_mtbf_s(cfg, n), 2),
            "dp_checkpoint_interval_s": round(young_daly_interval_s(cfg, cluster_mtbf_s(cfg, n)), 2),
        }
        for n in CHIPS
    }
    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(cfg).items()}
    return {"config": config, "derived": derived}


def table_report(cfg: SimConfig, seed: int = 0) -> dict[str, Any]:
    """The JSON document: chips, goodput per strategy, the paper's figures and the largest error."""
    goodput = run_table(cfg, seed)
    return {
        "chips": list(CHIPS),
        "goodput": {s: [round(g, 4) for g in goodput[s]] for s in STRATEGIES},
        "paper": {s: [p / 100 for p in PAPER_TABLE[s]] for s in STRATEGIES},
        "max_abs_error_points": round(max_abs_error_points(goodput), 2),
        "seed": seed,
        "assumptions": assumptions(cfg),
    }

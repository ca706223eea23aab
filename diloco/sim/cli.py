"""CLI entry for the goodput simulator (registered as `diloco simulate-goodput`).

Contract: prints the table (simulated vs the paper) and writes JSON / PNG only where asked; a bad
option is a one-line error naming it (exit 2) and nothing is written.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from diloco.configs import ConfigError
from diloco.sim.model import SECONDS_PER_YEAR, SimConfig
from diloco.sim.table import LABELS, PAPER_TABLE, sweep_mtbf, sweep_recovery, table_report


def _config(mtbf_years: float, restart_s: float | None, num_failures: int | None) -> SimConfig:
    changes: dict[str, float] = {"mtbf_chip_s": mtbf_years * SECONDS_PER_YEAR}
    if restart_s is not None:
        changes["restart_s"] = restart_s
    if num_failures is not None:
        changes["num_failures"] = num_failures
    try:
        return SimConfig().with_(**changes)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _print_table(report: dict, console: Console) -> None:
    chips = report["chips"]
    table = Table(title="Goodput % under failures — simulated (paper Table 1)")
    table.add_column("strategy", no_wrap=True)
    for n in chips:
        table.add_column(f"{n / 1e6:g}M" if n >= 1e6 else f"{n // 1000}k", justify="right")
    for strategy, goodput in report["goodput"].items():
        paper = PAPER_TABLE.get(strategy)
        cells = [f"{100 * g:.1f}" + (f" ({paper[i]})" if paper else "") for i, g in enumerate(goodput)]
        table.add_row(LABELS.get(strategy, strategy), *cells)
    console.print(table)
    console.print(f"max |simulated - paper| = {report['max_abs_error_points']:.2f} points")


def simulate_goodput(
    json_path: Path | None = None,
    plot_path: Path | None = None,
    mtbf_years: float = 1.0,
    restart_s: float | None = None,
    seed: int = 0,
    num_failures: int | None = None,
    sweep: bool = False,
) -> None:
    """Goodput of data-parallel, elastic data-parallel and Decoupled DiLoCo at 150k-2.4M chips."""
    cfg = _config(mtbf_years, restart_s, num_failures)
    console = Console()
    report = table_report(cfg, seed)
    if sweep:
        report["sweep"] = {"mtbf": sweep_mtbf(cfg, seed), "recovery": sweep_recovery(cfg, seed)}
    _print_table(report, console)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {json_path}")
    if plot_path is not None:
        from diloco.sim.plot import plot_goodput  # matplotlib only when a plot is asked for

        plot_goodput(report, plot_path)
        console.print(f"wrote {plot_path}")

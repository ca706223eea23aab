"""Plot of goodput against chips per strategy, with the paper's Table 1 as markers (matplotlib, Agg).

Contract: `plot_goodput` writes one PNG at `path` (parent folders created) and returns the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from diloco.sim.table import LABELS, PAPER_TABLE  # noqa: E402


def plot_goodput(report: dict[str, Any], path: Path) -> Path:
    """Simulated goodput (lines) and the paper's figures (open markers) against chips, log x."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    chips = report["chips"]
    for strategy, goodput in report["goodput"].items():
        (line,) = ax.plot(chips, [100 * g for g in goodput], marker="o", label=LABELS.get(strategy, strategy))
        if strategy in PAPER_TABLE:
            ax.plot(
                chips,
                PAPER_TABLE[strategy],
                linestyle="none",
                marker="s",
                fillstyle="none",
                color=line.get_color(),
            )
    ax.set_xscale("log")
    ax.set_xticks(chips, [f"{c / 1e6:g}M" if c >= 1e6 else f"{c // 1000}k" for c in chips])
    ax.minorticks_off()
    ax.set_ylim(0, 100)
    ax.set_xlabel("chips (per-chip MTBF 1 year)")
    ax.set_ylabel("goodput %")
    ax.set_title("Goodput under failures: simulated (lines) vs paper Table 1 (squares)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""`diloco bench ranks`: tokens per second of one learner with 1 and with 2 ranks, measured in the same run.

Contract: the bench recipe (or --config) on this machine's CPU (one thread per rank, gloo) or, when present,
CUDA; each rank count is a real learner process (a torch.distributed world for 2) training `--phases` phases
on a fresh file:// run; tokens/s is the learner's tokens over its phases' wall time, the first phase (warm-up)
left out. Prints a table, writes JSON {"rows": [{"ranks", "tokens_per_s", ...}], "speedup_2_vs_1", ...}.
It also measures one rank at half the batch (what each of 2 ranks computes): `ideal_speedup` = 2 x that
rank's tokens/s over the full-batch rank's, the speedup 2 ranks would reach with free communication. On a
model so small that half a batch takes much more than half the time (the bench recipe on these CPUs), that
bound is below 2, and no rank count can beat it; `-o model.d_model=256` etc. shows a compute-bound model.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

TARGET_SPEEDUP = 1.5  # on these 2-core machines, CPU, one thread per rank


def _measure(cfg_name: str, ranks: int, phases: int, root: Path, overrides: dict[str, Any] | None = None,
             half_batch: bool = False) -> dict[str, Any]:
    from diloco.configs import load_config
    from diloco.run.create import create_run
    from diloco.run.events import read_events
    from diloco.storage import open_store

    url, run_id = f"file://{root}/store", f"ranks-{ranks}{'-half' if half_batch else ''}"
    cfg = load_config(cfg_name).with_overrides({**(overrides or {}), "learner.ranks": ranks, "run.num_learners": 1,
                                                "learner.local_state_every_steps": 0})
    if half_batch:
        cfg = cfg.with_overrides({"data.batch_size": max(1, cfg.data.batch_size // 2)})
    ctx = create_run(open_store(url), run_id, cfg)
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "diloco.launch", "learner", "--storage", url, "--run-id", run_id,
                           "--name", ctx.learners[0], "--phases", str(phases)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the {ranks}-rank learner failed:\n{done.stderr[-2000:]}")
    measured = [e for e in read_events(ctx.store, ctx.keys) if e.get("kind") == "phase"][1:]
    tokens, seconds = sum(e["tokens"] for e in measured), sum(e["duration_s"] for e in measured)
    return {"ranks": ranks, "batch_size": cfg.data.batch_size,
            "tokens_per_s": tokens / seconds if seconds else 0.0, "phases_measured": len(measured),
            "tokens": tokens, "phase_s": seconds, "wall_s": time.time() - t0}


def bench_ranks(json_path: Path | None = None, config: str = "bench", phases: int = 6,
                overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """One learner at 1 and at 2 ranks on the same recipe and data; the table, and JSON when asked."""
    import torch

    if phases < 2:
        from diloco.configs import ConfigError

        raise ConfigError("--phases must be >= 2 (the first phase is a warm-up, not measured)")
    with tempfile.TemporaryDirectory(prefix="diloco-bench-ranks-") as tmp:
        rows = [_measure(config, ranks, phases, Path(tmp), overrides) for ranks in (1, 2)]
        half = _measure(config, 1, phases, Path(tmp), overrides, half_batch=True)
    speedup = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"] if rows[0]["tokens_per_s"] else 0.0
    ideal = 2 * half["tokens_per_s"] / rows[0]["tokens_per_s"] if rows[0]["tokens_per_s"] else 0.0
    device = "cuda: " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    result = {"rows": rows, "speedup_2_vs_1": speedup, "half_batch_row": half, "ideal_speedup": ideal,
              "efficiency_vs_ideal": speedup / ideal if ideal else 0.0, "overrides": overrides or {},
              "config": config, "phases": phases, "device": device,
              "target_speedup": TARGET_SPEEDUP if not torch.cuda.is_available() else None,
              "load_avg_1m": os.getloadavg()[0], "machine": platform.machine()}
    table = Table(title=f"one learner, 1 vs 2 ranks ({config} recipe, {device})")
    for col in ("ranks", "batch/rank", "tokens/s", "phases", "wall s"):
        table.add_column(col, justify="right")
    for r in (*rows, half):
        per_rank = r["batch_size"] // r["ranks"]
        table.add_row(str(r["ranks"]), str(per_rank), f"{r['tokens_per_s']:,.0f}", str(r["phases_measured"]),
                      f"{r['wall_s']:.1f}")
    Console().print(table)
    Console().print(f"ideal 2-rank speedup (2 x one rank at half the batch, no communication): {ideal:.2f}x; "
                    f"reached {speedup / ideal if ideal else 0.0:.0%} of it")
    Console().print(f"speedup 2 vs 1 rank: {speedup:.2f}x" + (f" (target >= {TARGET_SPEEDUP} on CPU)"
                                                              if result["target_speedup"] else ""))
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result

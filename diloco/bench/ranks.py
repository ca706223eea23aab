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

import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

from diloco.bench.harness import BenchResult, Opt, Table, benchmark

TARGET_SPEEDUP = 1.5  # on these 2-core machines, CPU, one thread per rank


def _measure(cfg_name: str, ranks: int, phases: int, root: Path, overrides: dict[str, Any] | None = None,
             half_batch: bool = False) -> dict[str, Any]:
    from diloco.configs import load_config
    from diloco.run.create import create_run
    from diloco.run.events import read_events
    from diloco.storage import open_store

    url, run_id = f"file://{root}/store", f"ranks-{ranks}{'-half' if half_batch else ''}"
    cfg = load_config(cfg_name).with_overrides({**(overrides or {}), "learner.ranks": ranks,
                                                "run.num_learners": 1, "learner.local_state_every_steps": 0})
    if half_batch:
        cfg = cfg.with_overrides({"data.batch_size": max(1, cfg.data.batch_size // 2)})
    ctx = create_run(open_store(url), run_id, cfg)
    t0 = time.time()
    command = [sys.executable, "-m", "diloco.launch", "learner", "--storage", url, "--run-id", run_id,
               "--name", ctx.learners[0], "--phases", str(phases)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the {ranks}-rank learner failed:\n{done.stderr[-2000:]}")
    measured = [e for e in read_events(ctx.store, ctx.keys) if e.get("kind") == "phase"][1:]
    tokens, seconds = sum(e["tokens"] for e in measured), sum(e["duration_s"] for e in measured)
    return {"ranks": ranks, "batch_size": cfg.data.batch_size,
            "tokens_per_s": tokens / seconds if seconds else 0.0, "phases_measured": len(measured),
            "tokens": tokens, "phase_s": seconds, "wall_s": time.time() - t0}


@benchmark(config="bench")
def bench_ranks(
    config: str = "bench",
    phases: Annotated[int, Opt("--phases", min=2,
                               help="Phases per learner (the first is not measured).")] = 6,
    overrides: Annotated[list[str], Opt("-o", "--override", help="key=value of the recipe (repeatable), "
                                                                "e.g. -o model.d_model=256.")] = [],  # noqa: B006
) -> BenchResult:
    """Tokens/s of one learner with 1 and with 2 ranks (torch.distributed inside the learner)."""
    import torch

    from diloco.configs import ConfigError, parse_overrides

    if phases < 2:
        raise ConfigError("--phases must be >= 2 (the first phase is a warm-up, not measured)")
    parsed = parse_overrides(list(overrides))
    with tempfile.TemporaryDirectory(prefix="diloco-bench-ranks-") as tmp:
        rows = [_measure(config, ranks, phases, Path(tmp), parsed) for ranks in (1, 2)]
        half = _measure(config, 1, phases, Path(tmp), parsed, half_batch=True)
    speedup = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"] if rows[0]["tokens_per_s"] else 0.0
    ideal = 2 * half["tokens_per_s"] / rows[0]["tokens_per_s"] if rows[0]["tokens_per_s"] else 0.0
    cuda = torch.cuda.is_available()
    device = "cuda: " + torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores)"
    result = {"rows": rows, "speedup_2_vs_1": speedup, "half_batch_row": half, "ideal_speedup": ideal,
              "efficiency_vs_ideal": speedup / ideal if ideal else 0.0, "overrides": parsed or {},
              "config": config, "phases": phases, "device": device,
              "target_speedup": TARGET_SPEEDUP if not torch.cuda.is_available() else None,
              "load_avg_1m": os.getloadavg()[0], "machine": platform.machine()}
    table = Table(f"one learner, 1 vs 2 ranks ({config} recipe, {device})",
                  ["ranks", "batch/rank", "tokens/s", "phases", "wall s"])
    table.rows = [[str(r["ranks"]), str(r["batch_size"] // r["ranks"]), f"{r['tokens_per_s']:,.0f}",
                   str(r["phases_measured"]), f"{r['wall_s']:.1f}"] for r in (*rows, half)]
    target = f" (target >= {TARGET_SPEEDUP} on CPU)" if result["target_speedup"] else ""
    reached = speedup / ideal if ideal else 0.0
    notes = [f"ideal 2-rank speedup (2 x one rank at half the batch, no communication): {ideal:.2f}x; "
             f"reached {reached:.0%} of it", f"speedup 2 vs 1 rank: {speedup:.2f}x{target}"]
    return BenchResult(result, [table], notes)

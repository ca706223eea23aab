"""`diloco bench merge`: wall time and peak memory of one Merger.merge_once vs learners and model size.

Contract: each measurement runs in a fresh spawned process (so ru_maxrss is a clean high-water
mark) against a file:// store prepared by the parent; prints a table, writes JSON {"rows": [...]}.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import resource
import sys
import tempfile
import time
from typing import Annotated, Any

import torch

from diloco.bench.harness import BenchResult, Opt, Table, benchmark
from diloco.configs import Config, ConfigError, load_config
from diloco.run.chain_state import chain_params
from diloco.run.context import open_run
from diloco.run.create import create_run
from diloco.run.objects import encode_tensors
from diloco.storage import open_store, read_latest

SIZES = {  # model overrides; "bench" is the recipe's own model
    "bench": {},
    "10m": {"model.n_layer": 4, "model.n_head": 8, "model.d_model": 448, "model.ctx_len": 64},
    "tiny": {"model.n_layer": 1, "model.n_head": 2, "model.d_model": 32, "model.ctx_len": 32},
}
DEFAULT_LEARNERS = "2,4,8,16,32,64"


def _publish_fake_deltas(cfg: Config, storage: str, run_id: str) -> int:
    """Version 0 plus one Gaussian delta per learner (the learner codec); returns the delta size."""
    ctx = create_run(open_store(storage), run_id, cfg)
    params = chain_params(ctx, read_latest(ctx.store, ctx.keys))
    gen = torch.Generator().manual_seed(0)
    size = 0
    for i, name in enumerate(ctx.learners):
        delta = {k: torch.randn(v.shape, generator=gen) * 1e-3 for k, v in params.items()}
        meta = {"learner": name, "seq": 0, "base_version": 0, "tokens": 1024 * (i + 1), "steps": 50,
                "phase_time_s": 1.0, "train_loss": 2.0, "created_at": 0.0}
        data = encode_tensors(delta, codec_name=cfg.learner.codec, kind="delta", fingerprint=ctx.fingerprint,
                                meta=meta)
        ctx.store.put_if_absent(ctx.keys.delta(name, 0), data)
        size = len(data)
    return size


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _measure_child(storage: str, run_id: str, queue: Any) -> None:
    """In a fresh process: load the merger, then time one merge and its RSS high-water mark."""
    import gc

    from diloco.merger.merger import Merger

    torch.set_num_threads(1)
    merger = Merger(open_run(storage, run_id))
    merger.load()
    gc.collect()
    before = _max_rss_bytes()
    t0 = time.perf_counter()
    manifest = merger.merge_once()
    wall = time.perf_counter() - t0
    merged = len(manifest.merged()) if manifest else 0
    queue.put({"merge_s": wall, "rss_before_bytes": before, "peak_rss_delta_bytes": _max_rss_bytes() - before,
               "merged": merged})


def in_fresh_process(target: Any, args: tuple, timeout_s: float = 1800.0) -> Any:
    """Run target(*args, queue) in a freshly spawned process (a clean ru_maxrss); returns what it put.
    RuntimeError when the process dies first (killed for memory, an error) or runs past timeout_s."""
    spawn = mp.get_context("spawn")
    queue = spawn.Queue()
    proc = spawn.Process(target=target, args=(*args, queue))
    proc.start()
    deadline = time.time() + timeout_s
    while True:
        try:
            got = queue.get(timeout=1.0)
            break
        except queue_module.Empty:
            if not proc.is_alive() or time.time() > deadline:
                proc.kill()
                raise RuntimeError("the measuring process ended without a result "
                                   f"(exit code {proc.exitcode})") from None
    proc.join()
    return got


def measure(size: str, num_learners: int, codec: str = "int4") -> dict[str, Any]:
    """One row: prepare a run with `num_learners` deltas, merge them once in a fresh process."""
    cfg = load_config("bench").with_overrides({
        **SIZES[size], "run.num_learners": num_learners, "merger.quorum": num_learners,
        "merger.grace_cap_s": 0.0, "learner.codec": codec,
    })
    num_params = sum(v.numel() for v in _model_params(cfg))
    with tempfile.TemporaryDirectory(prefix="diloco-merge-bench-") as tmp:
        storage = f"file://{tmp}"
        delta_bytes = _publish_fake_deltas(cfg, storage, "merge-bench")
        row = in_fresh_process(_measure_child, (storage, "merge-bench"))
    return {"size": size, "num_params": num_params, "num_learners": num_learners, "codec": codec,
            "delta_bytes": delta_bytes, "model_fp32_bytes": 4 * num_params, **row,
            "peak_rss_delta_models": row["peak_rss_delta_bytes"] / (4 * num_params)}


def _model_params(cfg: Config) -> list[torch.Tensor]:
    from diloco.training.model import build_model, get_flat_params

    return list(get_flat_params(build_model(cfg.model, seed=0)).values())


def _table(rows: list[dict[str, Any]]) -> Table:
    table = Table("one merge_once on file:// (fresh process each; 1 torch thread; peak = ru_maxrss delta)",
                  ["model", "params", "learners", "delta", "merge s", "peak RSS +", "x model fp32"])
    for r in rows:
        table.rows.append([r["size"], f"{r['num_params']:,}", str(r["num_learners"]),
                           f"{r['delta_bytes'] / 1e6:.2f} MB", f"{r['merge_s']:.3f}",
                           f"{r['peak_rss_delta_bytes'] / 1e6:.1f} MB", f"{r['peak_rss_delta_models']:.1f}"])
    return table


@benchmark()
def bench_merge(
    sizes: Annotated[str, Opt("--sizes",
                              help="Comma-separated model sizes: bench, 10m, tiny.")] = "bench,10m",
    learners: Annotated[str, Opt("--learners", help="Comma-separated learner counts.")] = DEFAULT_LEARNERS,
    codec: Annotated[str, Opt("--codec", help="Delta codec of the synthetic deltas.")] = "int4",
) -> BenchResult:
    """Time and peak memory of one merge against the number of learners and the model size."""
    try:
        counts = [int(x) for x in learners.split(",")]
        chosen = sizes.split(",")
        if any(c < 1 for c in counts) or any(s not in SIZES for s in chosen):
            raise ValueError
    except ValueError:
        raise ConfigError(f"--learners must be positive ints, --sizes among {', '.join(SIZES)}") from None
    rows = []
    for size in chosen:
        for n in counts:
            rows.append(measure(size, n, codec))
            print(f"  {size} x {n} learners: {rows[-1]['merge_s']:.3f}s, "
                  f"+{rows[-1]['peak_rss_delta_bytes'] / 1e6:.1f} MB", file=sys.stderr)
    return BenchResult({"rows": rows}, [_table(rows)])

"""`diloco bench scale`: merge memory, merge time and peak upload against the number of fragments, at GPT-2
small's size (124M parameters), with M synthetic int4 deltas per fragment merged by the real sharded merger.

Contract: each row merges one whole round (every fragment, every learner) in a fresh spawned process on a
file:// store the parent prepared (ru_maxrss growth over the round is clean); the upload figures come from
the staggered schedule (fragment p due at step p*H/P) and the encoded sizes; prints a table, writes JSON.
Peak RSS is the child's own VmHWM, reset before the round (ru_maxrss would carry the parent's across exec).
Each row also times, in the same child after the round, what the merge-time target is measured against (reading
and decoding the round's deltas) and the round's state traffic alone (state_io_s): the floor of a round.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from diloco.bench.merge import in_fresh_process
from diloco.configs import Config, ConfigError, load_config
from diloco.run.fragments import fragment_context
from diloco.run.objects import decode_tensors, encode_tensors
from diloco.storage import open_store
from diloco.training.fragments import due_offset

SIZES = {  # GPT-2 small's shape with its vocabulary (tied embeddings: 124.4M); quick: the tests' model
    "124m": {"model.n_layer": 12, "model.n_head": 12, "model.d_model": 768, "model.ctx_len": 1024,
             "model.vocab_size": 50257},
    "10m": {"model.n_layer": 4, "model.n_head": 8, "model.d_model": 448, "model.ctx_len": 64},  # bench merge's
    "quick": {"model.n_layer": 2, "model.n_head": 2, "model.d_model": 64, "model.ctx_len": 32},
}
STEPS_PER_PHASE = 24  # the paper's H (= P at P = 24: one fragment out per step)
DELTA_SCALE = 1e-3  # synthetic deltas: N(0, 1e-3), the size of an AdamW phase's movement at lr 3e-3


def bench_config(size: str, num_learners: int, num_fragments: int) -> Config:
    return load_config("bench").with_overrides({
        **SIZES[size], "run.num_learners": num_learners, "merger.quorum": num_learners, "merger.grace_cap_s": 0.0,
        "learner.codec": "int4", "inner.steps_per_phase": max(STEPS_PER_PHASE, num_fragments),
        "fragments.count": num_fragments, "fragments.overlap_steps": 2, "merger.shards": 1,
        "data.batch_size": 1, "eval.batch_size": 1, "eval.num_batches": 1, "learner.local_state_every_steps": 0})


def _fragment_shapes(ctx) -> list[dict[str, list[int]]]:
    if ctx.fragments:
        return [{p["key"]: p["shape"] for p in f["pieces"]} for f in ctx.fragments]
    return [{e["name"]: e["shape"] for e in ctx.layout}]


def _publish(cfg: Config, storage: str, run_id: str) -> tuple[list[int], list[int]]:
    """Create the run and one int4 delta per (fragment, learner), one at a time (O(fragment) memory);
    returns (learner 0's encoded bytes per fragment, fp32 bytes per fragment)."""
    from diloco.run.create import create_run

    ctx = create_run(open_store(storage), run_id, cfg)
    sizes, fp32 = [], []
    for index, shapes in enumerate(_fragment_shapes(ctx)):
        keys = fragment_context(ctx, index).keys
        fp32.append(4 * sum(torch.Size(s).numel() for s in shapes.values()))
        for m, name in enumerate(ctx.learners):
            gen = torch.Generator().manual_seed(1000 * index + m)
            delta = {k: torch.randn(s, generator=gen) * DELTA_SCALE for k, s in shapes.items()}
            meta = {"learner": name, "seq": 0, "base_version": 0, "tokens": 1024 * (m + 1),
                    "steps": cfg.inner.steps_per_phase, "phase_time_s": 1.0, "train_loss": 2.0, "created_at": 0.0}
            data = encode_tensors(delta, codec_name="int4", kind="delta", fingerprint=ctx.fingerprint, meta=meta)
            ctx.store.put_if_absent(keys.delta(name, 0), data)
            if m == 0:
                sizes.append(len(data))
            del delta, data
    return sizes, fp32


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> int:
    """Start a fresh high-water mark of this process's RSS now; returns the RSS in bytes. ru_maxrss is no use
    here: a spawned process inherits its parent's high-water mark across exec (Linux), so a parent that once
    held the whole model would hide the child's peak. VmHWM is reset by writing 5 to clear_refs."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The RSS high-water mark since reset_peak_rss (VmHWM)."""
    return _status_kib("VmHWM") * 1024


def _merge_child(storage: str, run_id: str, queue: Any) -> None:
    """In a fresh process: one round by the real merger (all fragments), then read + decode the same deltas."""
    import gc

    from diloco.merger.loop import ShardMerger
    from diloco.run.context import open_run

    torch.set_num_threads(1)
    ctx = open_run(storage, run_id)
    # every chain read for its merge and released (a shard's fragment), at P = 1 too, so every row measures the same
    # round (a whole-model run's merger keeps its state between merges instead: keep_state, not measured here)
    shard = ShardMerger(ctx, 0, keep_state=False)
    gc.collect()
    before = reset_peak_rss()
    t0 = time.perf_counter()
    merged = shard.poll_once()
    merge_s = time.perf_counter() - t0
    peak = peak_rss_bytes() - before
    t0 = time.perf_counter()
    for index in range(len(ctx.fragments) or 1):
        keys = fragment_context(ctx, index).keys
        for name in ctx.learners:
            decode_tensors(ctx.store.get(keys.delta(name, 0)))
    read_decode_s = time.perf_counter() - t0
    if len(merged) != (len(ctx.fragments) or 1):  # state_io_s pairs the i-th merge with fragment i
        raise RuntimeError(f"{len(merged)} merges for {len(ctx.fragments) or 1} fragments")
    queue.put({"merge_s": merge_s, "peak_rss_bytes": peak, "read_decode_s": read_decode_s,
               "state_io_s": state_io_s(ctx, merged), "merged": sum(len(m.merged()) for m in merged),
               "merges": len(merged)})


def state_io_s(ctx, merged: list) -> float:
    """The state traffic of a round with no arithmetic: each merged fragment's params and outer state read back
    (checked, decoded) and written again as a version writes them (write_state: put, fsync, checksum), one
    fragment at a time. A merger that holds O(fragment) cannot keep its fragments' state between rounds, so a
    round cannot take less than this plus reading and decoding its deltas."""
    from diloco.run.objects import read_tensors, write_state

    t0 = time.perf_counter()
    for index, manifest in enumerate(merged):  # one merge per fragment, in order (_merge_child checks the count)
        fctx = fragment_context(ctx, index)
        _, params = read_tensors(ctx.store, manifest.params_key, checksum=manifest.params_checksum)
        _, outer = read_tensors(ctx.store, manifest.outer_key, checksum=manifest.outer_checksum)
        for what, tensors in (("params", params), ("outer", outer)):
            write_state(ctx.store, f"{fctx.keys.global_prefix()}scratch-{what}", tensors, kind=what,
                        fingerprint=ctx.fingerprint, consume=True)
        del params, outer
    return time.perf_counter() - t0


def peak_window_bytes(fragment_bytes: list[int], steps_per_phase: int) -> int:
    """The most one learner uploads in any window of H/P steps of the staggered schedule (two phases)."""
    count = len(fragment_bytes)
    window = max(1, steps_per_phase // count)
    uploads = [0] * (2 * steps_per_phase + 1)
    for index, size in enumerate(fragment_bytes):
        first = due_offset(index, count, steps_per_phase) or steps_per_phase
        for step in range(first, len(uploads), steps_per_phase):
            uploads[step] += size
    return max(sum(uploads[s:s + window]) for s in range(1, len(uploads) - window + 1))


def measure_row(size: str, num_learners: int, num_fragments: int) -> dict[str, Any]:
    cfg = bench_config(size, num_learners, num_fragments)
    with tempfile.TemporaryDirectory(prefix="diloco-scale-bench-") as tmp:
        storage = f"file://{tmp}"
        sizes, fp32 = _publish(cfg, storage, "scale")
        got = in_fresh_process(_merge_child, (storage, "scale"), timeout_s=3600.0)
    if got["merged"] != num_learners * num_fragments:
        raise RuntimeError(f"P={num_fragments}: merged {got['merged']} deltas, expected {num_learners * num_fragments}")
    return {"fragments": num_fragments, "largest_fragment_mb": max(fp32) / 1e6,
            "merge_peak_rss_mb": got["peak_rss_bytes"] / 1e6, "merge_s_per_round": got["merge_s"],
            "publish_mb": sum(sizes) / len(sizes) / 1e6,
            "_peak_window_bytes": peak_window_bytes(sizes, cfg.inner.steps_per_phase),
            "_whole_bytes": sum(sizes), "read_decode_s": got["read_decode_s"], "state_io_s": got["state_io_s"],
            "merge_vs_read_decode": got["merge_s"] / got["read_decode_s"], "_params": sum(fp32) // 4}


def codec_speed(num_elements: int, repeats: int = 3) -> dict[str, float]:
    """int4 encode and decode speed, MB of fp32 tensor per second (the best of `repeats`)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(num_elements, generator=gen) * DELTA_SCALE}
    mb = 4 * num_elements / 1e6
    enc, dec = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = encode_tensors(tensors, codec_name="int4", kind="delta", fingerprint="bench")
        enc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decode_tensors(data)
        dec.append(time.perf_counter() - t0)
    return {"encode_mb_s": mb / min(enc), "decode_mb_s": mb / min(dec)}


def _print(result: dict[str, Any]) -> None:
    table = Table(title=f"bench scale: {result['model_params']:,} params, {result['learners']} learners, int4, "
                        "one round merged by the real merger (fresh process per row)")
    for col in ("P", "largest frag MB", "merge peak RSS MB", "target MB", "merge s/round", "read+decode s",
                "state I/O s", "publish MB", "peak upload vs P=1", "target"):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        table.add_row(str(row["fragments"]), f"{row['largest_fragment_mb']:.1f}", f"{row['merge_peak_rss_mb']:.0f}",
                      f"{4 * row['largest_fragment_mb'] + 300:.0f}", f"{row['merge_s_per_round']:.2f}",
                      f"{row['read_decode_s']:.2f}", f"{row['state_io_s']:.2f}", f"{row['publish_mb']:.2f}",
                      f"{row['peak_upload_ratio_vs_unfragmented']:.3f}", f"{1.4 / row['fragments']:.3f}")
    Console().print(table)
    codec = result["codec"]["int4"]
    Console().print(f"int4 codec: encode {codec['encode_mb_s']:.0f} MB/s, decode {codec['decode_mb_s']:.0f} MB/s")


def bench_scale(json_path: Path | None = None, params: str = "124m", learners: int = 8,
                fragments: str = "1,4,12,24", quick: bool = False) -> dict[str, Any]:
    """The table and JSON of `diloco bench scale` (`quick`: the small model, for tests)."""
    size = "quick" if quick else params
    try:
        counts = [int(x) for x in fragments.split(",")]
        if size not in SIZES or learners < 1 or any(c < 1 for c in counts):
            raise ValueError
    except ValueError:
        raise ConfigError(f"--params must be one of {', '.join(s for s in SIZES if s != 'quick')}, --learners >= 1, "
                          "--fragments comma-separated ints >= 1") from None
    rows = []
    for count in counts:
        rows.append(measure_row(size, learners, count))
        print(f"  P={count}: merge {rows[-1]['merge_s_per_round']:.2f}s, peak RSS +{rows[-1]['merge_peak_rss_mb']:.0f} "
              f"MB", file=sys.stderr)
    whole = next((r["_whole_bytes"] for r in rows if r["fragments"] == 1), None)
    params_count = rows[0]["_params"]
    for r in rows:
        reference = whole if whole is not None else r["_whole_bytes"]  # one publish of the whole model
        r["peak_upload_ratio_vs_unfragmented"] = r.pop("_peak_window_bytes") / reference
        r.pop("_params")
        r.pop("_whole_bytes")
    result = {"model_params": params_count, "learners": learners, "rows": rows,
              "codec": {"int4": codec_speed(1 << 16 if quick else 1 << 24)}}
    _print(result)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result

"""`diloco bench scale`: merge memory, merge time, bucket growth, a merger's restart, a learner's rejoin and
peak upload against the number of fragments, at GPT-2 small's size (124M parameters), with M synthetic int4
deltas per fragment and round merged by the production merger: one process holding every chain's state, a
checkpoint every K versions (`state.checkpoint_every`), over 3 K rounds.

Contract: each row runs its merger in fresh spawned processes on a file:// run the parent prepared (the
VmHWM growth over a round is the merge's, not the state it holds; the first round, which also allocates
the outer state the merger holds from then on, is reported apart): rounds 1..3K-1; then a learner rejoins
from nothing at version 3K - 1 (K - 1 versions past checkpoint 2K); then a merger starts cold there
(checkpoint 2K + K - 1 replayed merges: `recovery_s`) and merges round 3K, whose checkpoint lands. The
bytes are everything the merger side put in those 3K rounds; the upload figures come from the staggered
schedule (fragment p due at step p*H/P) and the encoded sizes; prints a table, writes JSON. Each row also
times, in the same process after its rounds, what the merge-time target is measured against (reading and
decoding a round's deltas).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from typing import Annotated, Any

import torch

from diloco.bench._scale_rounds import rejoin_child, rounds_child, template_key
from diloco.bench.harness import BenchResult, Opt, Table, benchmark
from diloco.bench.merge import in_fresh_process
from diloco.configs import Config, ConfigError, load_config
from diloco.configs.schema import checkpoint_every as interval_of
from diloco.run.heap import status_bytes
from diloco.run.objects import decode_tensors, encode_tensors
from diloco.storage import open_store
from diloco.training.fragments import due_offset

SIZES = {  # GPT-2 small's shape with its vocabulary (tied embeddings: 124.4M); quick: the tests' model
    "124m": {"model.n_layer": 12, "model.n_head": 12, "model.d_model": 768, "model.ctx_len": 1024,
             "model.vocab_size": 50257},
    # bench merge's
    "10m": {"model.n_layer": 4, "model.n_head": 8, "model.d_model": 448, "model.ctx_len": 64},
    "quick": {"model.n_layer": 2, "model.n_head": 2, "model.d_model": 64, "model.ctx_len": 32},
}
STEPS_PER_PHASE = 24  # the paper's H (= P at P = 24: one fragment out per step)
DELTA_SCALE = 1e-3  # synthetic deltas: N(0, 1e-3), the size of an AdamW phase's movement at lr 3e-3


def bench_config(size: str, num_learners: int, num_fragments: int,
                 checkpoint_every: int | None = None) -> Config:
    return load_config("bench").with_overrides({"state.checkpoint_every": checkpoint_every,
        **SIZES[size], "run.num_learners": num_learners, "merger.quorum": num_learners,
                                                "merger.grace_cap_s": 0.0,
        "learner.codec": "int4", "inner.steps_per_phase": max(STEPS_PER_PHASE, num_fragments),
        "fragments.count": num_fragments, "fragments.overlap_steps": 2, "merger.shards": 1,
        "data.batch_size": 1, "eval.batch_size": 1, "eval.num_batches": 1,
                                                "learner.local_state_every_steps": 0})


def _fragment_shapes(ctx) -> list[dict[str, list[int]]]:
    if ctx.fragments:
        return [{p["key"]: p["shape"] for p in f["pieces"]} for f in ctx.fragments]
    return [{e["name"]: e["shape"] for e in ctx.layout}]


def _publish(cfg: Config, storage: str, run_id: str) -> tuple[list[int], list[int]]:
    """Create the run and one int4 delta per (fragment, learner), one at a time (O(fragment) memory), kept as
    the templates of every round's deltas (outside the run); returns (learner 0's encoded bytes per
    fragment, fp32 bytes per fragment)."""
    from diloco.run.create import create_run

    ctx = create_run(open_store(storage), run_id, cfg)
    sizes, fp32 = [], []
    for index, shapes in enumerate(_fragment_shapes(ctx)):
        fp32.append(4 * sum(torch.Size(s).numel() for s in shapes.values()))
        for m, name in enumerate(ctx.learners):
            gen = torch.Generator().manual_seed(1000 * index + m)
            delta = {k: torch.randn(s, generator=gen) * DELTA_SCALE for k, s in shapes.items()}
            meta = {"learner": name, "seq": 0, "base_version": 0, "tokens": 1024 * (m + 1),
                    "steps": cfg.inner.steps_per_phase, "phase_time_s": 1.0, "train_loss": 2.0,
                    "created_at": 0.0}
            data = encode_tensors(delta, codec_name="int4", kind="delta", fingerprint=ctx.fingerprint,
                                  meta=meta)
            ctx.store.put(template_key(index, name), data)
            if m == 0:
                sizes.append(len(data))
            del delta, data
    return sizes, fp32


def _status(field: str) -> int:
    value = status_bytes(field)
    if value is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return value


def reset_peak_rss() -> int:
    """Start a fresh high-water mark of this process's RSS now; returns the RSS in bytes. ru_maxrss is no use
    here: a spawned process inherits its parent's high-water mark across exec (Linux), so a parent that once
    held the whole model would hide the child's peak. VmHWM is reset by writing 5 to clear_refs."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak_rss_bytes() -> int:
    """The RSS high-water mark since reset_peak_rss (VmHWM)."""
    return _status("VmHWM")


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


def measure_row(size: str, num_learners: int, num_fragments: int,
                checkpoint_every: int | None = None) -> dict[str, Any]:
    cfg = bench_config(size, num_learners, num_fragments, checkpoint_every)
    k = interval_of(cfg)
    rounds = 3 * k
    with tempfile.TemporaryDirectory(prefix="diloco-scale-bench-") as tmp:
        storage = f"file://{tmp}"
        sizes, fp32 = _publish(cfg, storage, "scale")
        first = in_fresh_process(rounds_child, (storage, "scale", 0, rounds - 2, True), timeout_s=7200.0)
        rejoin = in_fresh_process(rejoin_child, (storage, "scale"), timeout_s=3600.0)
        last = in_fresh_process(rounds_child, (storage, "scale", rounds - 1, rounds - 1, False),
                                timeout_s=3600.0)
    params = sum(fp32) // 4
    merge_s = statistics.median(first["merge_s"] + last["merge_s"])
    read_decode_s = statistics.median(first["read_decode_s"])  # of PASSES (_scale_rounds)
    per_version = (first["sent_bytes"] + last["sent_bytes"]) / rounds
    return {"fragments": num_fragments, "largest_fragment_mb": max(fp32) / 1e6,
            # the run's first merge (version 0 -> 1) also allocates the outer state the merger then holds
            # (momentum and residual: 8 B/param, zeros until then): held state, reported apart
            # the growth over a round plus the blocks its merges keep (MergeArenas: held between rounds)
            "merge_peak_rss_mb": max(first["peak_rss_bytes"][1:] + last["peak_rss_bytes"]) / 1e6,
            "merge_kept_mb": max(first["kept_bytes"] + last["kept_bytes"]) / 1e6,
            "merge_page_faults": statistics.median(first["faults"][1:] + last["faults"]),  # minor, a round
            "first_merge_peak_rss_mb": first["peak_rss_bytes"][0] / 1e6,
            "merge_s_per_round": merge_s, "publish_mb": sum(sizes) / len(sizes) / 1e6,
            "_peak_window_bytes": peak_window_bytes(sizes, cfg.inner.steps_per_phase),
            "_whole_bytes": sum(sizes), "read_decode_s": read_decode_s,
            "state_io_s": sum(first["checkpoint_s"] + last["checkpoint_s"]) / rounds,
            "merge_vs_read_decode": merge_s / read_decode_s,
            "bucket_bytes_per_version": per_version,
            "bucket_bytes_per_param_per_version": per_version / params,
            "recovery_s": last["load_s"], "recovery_replayed": last["replayed"],
            "rejoin_s": statistics.median(rejoin["rejoin_s"]), "rejoin_bytes": rejoin["rejoin_bytes"],
            "rejoin_full_params_s": statistics.median(rejoin["rejoin_full_params_s"]),
            # every timed pass of the three figures above measured once a row (their medians)
            "read_decode_runs_s": first["read_decode_s"], "rejoin_runs_s": rejoin["rejoin_s"],
            "rejoin_full_params_runs_s": rejoin["rejoin_full_params_s"],
            "merger_rss_mb": max(first["rss_high_bytes"] + last["rss_high_bytes"]) / 1e6,
            "state_held_mb": 12 * params / 1e6, "checkpoint_every": k, "rounds": rounds, "_params": params}


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


def _tables(result: dict[str, Any]) -> list[Table]:
    rows = result["rows"]
    table = Table(f"bench scale: {result['model_params']:,} params, {result['learners']} learners, int4, "
                  f"{rows[0]['rounds']} rounds merged by the production merger (K = "
                  f"{rows[0]['checkpoint_every']})",
                  ["P", "largest frag MB", "merge peak RSS MB", "target MB", "merge s/round", "read+decode s",
                   "ckpt s/round", "publish MB", "peak upload vs P=1", "target"])
    table.rows = [[str(row["fragments"]), f"{row['largest_fragment_mb']:.1f}",
                   f"{row['merge_peak_rss_mb']:.0f}",
                   f"{4 * row['largest_fragment_mb'] + 300:.0f}", f"{row['merge_s_per_round']:.2f}",
                   f"{row['read_decode_s']:.2f}", f"{row['state_io_s']:.2f}", f"{row['publish_mb']:.2f}",
                   f"{row['peak_upload_ratio_vs_unfragmented']:.3f}", f"{1.4 / row['fragments']:.3f}"]
                  for row in rows]
    log = Table("the log: bucket growth, a merger's cold restart, a learner's rejoin (targets at 124M: "
                "<= 1.5 B/param/version, <= 60 s, <= 2x the full-params rejoin)",
                ["P", "bucket MB/version", "B/param/version", "recovery s", "replayed", "rejoin s",
                 "rejoin MB", "full-params rejoin s", "state held MB", "merger RSS MB", "first merge MB"])
    log.rows = [[str(row["fragments"]), f"{row['bucket_bytes_per_version'] / 1e6:.1f}",
                 f"{row['bucket_bytes_per_param_per_version']:.3f}", f"{row['recovery_s']:.1f}",
                 str(row["recovery_replayed"]), f"{row['rejoin_s']:.2f}", f"{row['rejoin_bytes'] / 1e6:.0f}",
                 f"{row['rejoin_full_params_s']:.2f}", f"{row['state_held_mb']:.0f}",
                 f"{row['merger_rss_mb']:.0f}", f"{row['first_merge_peak_rss_mb']:.0f}"]
                for row in rows]
    return [table, log]


@benchmark(quick="A small model instead (seconds; the tests use it).")
def bench_scale(
    quick: bool = False,
    params: Annotated[str, Opt("--params", help="Model size: 124m (GPT-2 small's shape and vocabulary), "
                                                "10m.")] = "124m",
    learners: Annotated[int, Opt("--learners", min=1,
                                 help="Synthetic int4 deltas per fragment and round.")] = 8,
    fragments: Annotated[str, Opt("--fragments", help="Comma-separated fragment counts P.")] = "1,4,12,24",
    checkpoint_every: Annotated[int | None, Opt("--checkpoint-every", min=1,
                                                help="K (state.checkpoint_every; default the recipe's): 3K "
                                                     "rounds.")] = None,
) -> BenchResult:
    """Merge memory and time, bucket growth, a merger's restart, a learner's rejoin and peak upload against
    the number of fragments (3K rounds per P by the production merger)."""
    size = "quick" if quick else params
    try:
        counts = [int(x) for x in fragments.split(",")]
        if size not in SIZES or learners < 1 or any(c < 1 for c in counts):
            raise ValueError
    except ValueError:
        sizes = ", ".join(s for s in SIZES if s != "quick")
        raise ConfigError(f"--params must be one of {sizes}, --learners >= 1, --fragments comma-separated "
                          "ints >= 1") from None
    rows = []
    for count in counts:
        rows.append(measure_row(size, learners, count, checkpoint_every))
        row = rows[-1]
        print(f"  P={count}: merge {row['merge_s_per_round']:.2f}s, "
              f"peak RSS +{row['merge_peak_rss_mb']:.0f} MB, "
              f"{row['bucket_bytes_per_param_per_version']:.2f} B/param/version, "
              f"recovery {row['recovery_s']:.1f}s, "
              f"rejoin {row['rejoin_s']:.1f}s", file=sys.stderr)
    whole = next((r["_whole_bytes"] for r in rows if r["fragments"] == 1), None)
    params_count = rows[0]["_params"]
    for r in rows:
        reference = whole if whole is not None else r["_whole_bytes"]  # one publish of the whole model
        r["peak_upload_ratio_vs_unfragmented"] = r.pop("_peak_window_bytes") / reference
        r.pop("_params")
        r.pop("_whole_bytes")
    result = {"model_params": params_count, "learners": learners, "rows": rows,
              "codec": {"int4": codec_speed(1 << 16 if quick else 1 << 24)}}
    codec = result["codec"]["int4"]
    note = f"int4 codec: encode {codec['encode_mb_s']:.0f} MB/s, decode {codec['decode_mb_s']:.0f} MB/s"
    return BenchResult(result, _tables(result), [note])

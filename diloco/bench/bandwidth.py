"""`diloco bandwidth`: the link speed between sites that keeps learners >= 95% busy, DP vs DiLoCo; and how
fast the bucket grows (the log: an update a version, a checkpoint every K; against every version's full
state).

Contract: a closed-form traffic model (the one `bench quality` measures), no I/O but the optional JSON;
codec sizes come from encoding a fixed synthetic delta with the real codec, a checkpoint's from encoding a
Gaussian fp32 tensor as a checkpoint part is encoded (shuffled, zstd).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from diloco.bench.harness import BenchResult, Opt, Table, benchmark

FP32_BYTES = 4  # bytes per parameter of an uncompressed fp32 tensor
_SAMPLE_PARAMS = 1 << 20  # a 1M-parameter Gaussian delta measures each codec's size (header included)
STATE_TENSORS = 3  # a checkpoint's tensors per parameter: params, momentum, the update's residual (12 B raw)
FORMAT1_STATE_BYTES = 12.0  # a version's state objects before the log: params (4), outer state (8), raw fp32
MANIFEST_BYTES = 5_000  # a manifest at 8 learners (docs/STORAGE.md: ~1.9 KB + ~380 B a decision)


@functools.cache
def codec_bytes_per_param(codec: str) -> float:
    """Encoded bytes per parameter of a Gaussian delta under `codec` (4 / compression ratio)."""
    import numpy as np  # numpy and the codec when used: `diloco bandwidth` is built when the CLI starts

    from diloco.storage.codec import CODECS, encode

    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} must be one of {CODECS}")
    x = np.random.default_rng(0).standard_normal(_SAMPLE_PARAMS).astype(np.float32) * 1e-3
    data = encode({"w": x.reshape(1024, 1024)}, codec=codec, kind="delta", fingerprint="bandwidth", meta={})
    return len(data) / _SAMPLE_PARAMS


@functools.cache
def checkpoint_bytes_per_param() -> float:
    """Bytes per parameter of one fp32 state tensor in a chain checkpoint (byte-shuffled, zstd frames)."""
    import numpy as np

    from diloco.storage.codec import Encoder

    x = np.random.default_rng(0).standard_normal(_SAMPLE_PARAMS).astype(np.float32) * 2e-2
    encoder = Encoder(codec="fp32", kind="checkpoint", fingerprint="bandwidth", compression="zstd")
    encoder.add("w", x)
    return len(encoder.finish()) / _SAMPLE_PARAMS


def bucket_growth(num_params: int, num_learners: int, versions_per_hour: float, codec: str, update_codec: str,
                  checkpoint_every: int | None = None) -> dict[str, Any]:
    """Bytes a run stores a version and an hour (quorum = all: one delta per learner a version): the merger's
    side (the update, the manifest, 1/K of a checkpoint) and the learners' deltas; and the same before the
    log (every version's full state)."""
    from diloco.configs.schema import checkpoint_interval  # pydantic when used, not when the CLI starts

    k = checkpoint_interval(checkpoint_every, update_codec)
    update = codec_bytes_per_param(update_codec) * num_params
    checkpoint = STATE_TENSORS * checkpoint_bytes_per_param() * num_params
    merger = update + MANIFEST_BYTES + checkpoint / k
    deltas = num_learners * codec_bytes_per_param(codec) * num_params
    format1 = update + MANIFEST_BYTES + FORMAT1_STATE_BYTES * num_params
    return {"checkpoint_every": k, "checkpoint_bytes": checkpoint,
            "bucket_merger_bytes_per_version": merger,
            "bucket_merger_bytes_per_param_per_version": merger / num_params,
            "bucket_bytes_per_version": merger + deltas,
            "bucket_bytes_per_hour": (merger + deltas) * versions_per_hour,
            "bucket_bytes_per_day": (merger + deltas) * versions_per_hour * 24,
            "bucket_format1_bytes_per_version": format1 + deltas,
            "bucket_format1_bytes_per_hour": (format1 + deltas) * versions_per_hour,
            "versions_per_hour": versions_per_hour}


def allreduce_bytes_per_step(num_params: int, num_learners: int,
                             bytes_per_param: float = FP32_BYTES) -> float:
    """Bytes each learner sends (and receives) in one ring all-reduce: 2(M-1)/M x bytes x N."""
    if num_learners < 1 or num_params < 1:
        raise ValueError("num_params and num_learners must be >= 1")
    return 2.0 * (num_learners - 1) / num_learners * bytes_per_param * num_params


def required_gbps(bytes_per_round: float, compute_s: float, busy: float, overlapped: bool) -> float:
    """Link speed (Gbit/s, one direction) so that compute / wall time >= busy.

    overlapped: wall = max(compute, comm)      -> comm <= compute / busy
    exposed:    wall = compute + comm          -> comm <= compute * (1 - busy) / busy
    """
    if not 0 < busy < 1 or compute_s <= 0:
        raise ValueError(f"busy must be in (0, 1) and compute_s > 0; got {busy}, {compute_s}")
    allowed_s = compute_s / busy if overlapped else compute_s * (1 - busy) / busy
    return bytes_per_round * 8 / allowed_s / 1e9


def bandwidth_model(num_params: int, step_time_s: float, num_learners: int, inner_steps: int,
                    codec: str, update_codec: str = "fp32", busy: float = 0.95,
                    updates_per_phase: float = 1.0, checkpoint_every: int | None = None) -> dict[str, Any]:
    """Gbps per learner link for data-parallel (every step) and DiLoCo (every H steps).

    DP: fp32 ring all-reduce of the gradients each step; exposed (no overlap) and fully overlapped.
    DiLoCo: per phase one delta up and `updates_per_phase` compact updates down; links are full
    duplex, so the busier direction sets the speed; overlapped (decoupled: the next phase runs
    while the delta uploads) and exposed (synchronous DiLoCo waits for the merge).
    """
    if inner_steps < 1:
        raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
    dp_bytes = allreduce_bytes_per_step(num_params, num_learners)
    up = codec_bytes_per_param(codec) * num_params
    down = codec_bytes_per_param(update_codec) * num_params * updates_per_phase
    phase_bytes, phase_s = max(up, down), inner_steps * step_time_s
    out = {
        "num_params": num_params, "step_time_s": step_time_s, "num_learners": num_learners,
        "inner_steps": inner_steps, "codec": codec, "update_codec": update_codec, "busy": busy,
        "dp_bytes_per_step": dp_bytes, "delta_bytes": up, "update_bytes_per_phase": down,
        "dp_gbps_exposed": required_gbps(dp_bytes, step_time_s, busy, overlapped=False),
        "dp_gbps_overlapped": required_gbps(dp_bytes, step_time_s, busy, overlapped=True),
        "diloco_gbps_overlapped": required_gbps(phase_bytes, phase_s, busy, overlapped=True),
        "diloco_gbps_exposed": required_gbps(phase_bytes, phase_s, busy, overlapped=False),
    }
    out["reduction_overlapped"] = out["dp_gbps_overlapped"] / out["diloco_gbps_overlapped"]
    out["reduction_exposed"] = out["dp_gbps_exposed"] / out["diloco_gbps_overlapped"]
    out.update(bucket_growth(num_params, num_learners, 3600.0 / phase_s, codec, update_codec,
                             checkpoint_every))
    return out


def _tables(row: dict[str, Any]) -> list[Table]:
    link = Table(f"link speed for {row['busy']:.0%} busy learners (Gbit/s per learner, one direction)",
                 ["N params", "step s", "M", "H", "codec", "DP exposed", "DP overlapped", "DiLoCo overlapped",
                  "DiLoCo exposed", "reduction"])
    link.rows.append([
        f"{row['num_params']:.3g}", f"{row['step_time_s']:g}", str(row["num_learners"]),
                      str(row["inner_steps"]),
        f"{row['codec']}/{row['update_codec']}", f"{row['dp_gbps_exposed']:.4g}",
        f"{row['dp_gbps_overlapped']:.4g}", f"{row['diloco_gbps_overlapped']:.4g}",
        f"{row['diloco_gbps_exposed']:.4g}",
        f"{row['reduction_exposed']:.0f}x / {row['reduction_overlapped']:.0f}x",
    ])
    growth = Table(f"bucket growth (a version per phase; a checkpoint every K = {row['checkpoint_every']} "
                   "versions; before the log: every version's full state)",
                   ["merger B/param/version", "stored per version", "per hour", "per day", "before: per "
                                                                                           "version",
                    "before: per hour"])
    sizes = ("bytes_per_version", "bytes_per_hour", "bytes_per_day", "format1_bytes_per_version",
             "format1_bytes_per_hour")
    growth.rows.append([f"{row['bucket_merger_bytes_per_param_per_version']:.3f}",
                        *(_size(row[f"bucket_{k}"]) for k in sizes)])
    return [link, growth]


def _size(size: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"


@benchmark(json_help="Write the row as JSON here.")
def bandwidth(
    num_params: Annotated[float, Opt("--params", min=1, help="Model parameters, e.g. 12e9.")] = ...,
    step_time_s: Annotated[float, Opt("--step-time-s", min=1e-6, help="Seconds per inner step.")] = ...,
    num_learners: Annotated[int, Opt("--learners", min=1, help="Learners (sites) M.")] = ...,
    inner_steps: Annotated[int, Opt("--inner-steps", min=1, help="H: inner steps per phase.")] = ...,
    codec: Annotated[str, Opt("--codec",
                              help="Delta codec: fp32, bf16, int8, int4, int3, int2, nf2.")] = "int4",
    update_codec: Annotated[str, Opt("--update-codec",
                                     help="Codec of the compact update sent back.")] = "fp32",
    busy: Annotated[float, Opt("--busy", min=0.01, max=0.99,
                               help="Fraction of time learners compute.")] = 0.95,
    checkpoint_every: Annotated[int | None, Opt("--checkpoint-every", min=1,
                                                help="K of the bucket growth (default: from the update "
                                                     "codec).")] = None,
) -> BenchResult:
    """Bandwidth needed between sites: data-parallel all-reduce vs one delta per H steps; and the bucket's
    growth."""
    from diloco.configs import ConfigError
    from diloco.storage.codec import CODECS

    for name, value in (("--codec", codec), ("--update-codec", update_codec)):
        if value not in CODECS:
            raise ConfigError(f"{name} {value!r} must be one of {', '.join(CODECS)}")
    row = bandwidth_model(int(num_params), step_time_s, num_learners, inner_steps, codec, update_codec, busy,
                          checkpoint_every=checkpoint_every)
    return BenchResult(row, _tables(row))

"""`diloco bench wan`: wall-clock time to a target held-out loss when every learner's link to the bucket is
capped — data-parallel (modelled all-reduce), synchronous DiLoCo and Decoupled DiLoCo (real runs through
ThrottledStore), and torchft's DiLoCo (its loss measured, its all-reduce time modelled like DP's).

Contract: equal tokens for every method; prints a table per cap (the paper-equivalent cap X, 2X, X/2) and
writes JSON {"link_mb_s", "target_loss", "time_to_target_s": {...}, "speedup_vs_dp", "traffic_ratio_vs_dp":
{"sent", "received"}, "final_loss": {...}, "busy", "tokens_factor", "speedup_vs_dp_past_equal_tokens", "rows":
[...], "config"}; targets are reported, never assumed. What is modelled and what is measured is written into
the JSON ("model"). With `tokens_factor` F > 1 the DiLoCo methods (torchft's too) train F x data-parallel's
tokens, their schedules over that length: their time to data-parallel's target is then measured past equal
tokens, reported as speedup_vs_dp_past_equal_tokens, and speedup_vs_dp (equal tokens) is null. `--links real`
(bench/_wan_real.py) runs every learner and data-parallel's gloo ranks in network namespaces behind tbf-capped
veth links to a real S3 server, unpadded; the JSON then says "link_mode": "real", counts bytes with the kernel
(kernel_bytes_sent/received per learner) and times DP for real (dp_step_s_measured). Modelled links count
every byte through them (every object and listing, the bucket checkpoint at the engine's defaults);
"delta_traffic_ratio_vs_dp" beside is the deltas alone.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import torch

from diloco.bench._quality_runs import HeldOut
from diloco.bench._wan_report import (
    COMM_OVER_COMPUTE,
    REAL_TARGETS,
    TARGET_OVER_DP,
    TARGETS,
    config_record,
    shown,
)
from diloco.bench._wan_runs import WanResult, WanRun, run_wan
from diloco.bench.bandwidth import allreduce_bytes_per_step
from diloco.bench.harness import BenchResult, Opt, benchmark
from diloco.bench.throttle import LinkSpec
from diloco.configs import Config, ConfigError, load_config
from diloco.specs.gpt import load_corpus
from diloco.training.data import ShardSampler
from diloco.training.inner import InnerTrainer, evaluate
from diloco.training.model import build_model

CAP_FACTORS = (1.0, 2.0, 0.5)  # rows: the paper-equivalent cap, twice it, half of it
QUICK = {"inner.steps_per_phase": 10, "inner.warmup_steps": 5, "eval.num_batches": 2, "eval.batch_size": 16}
QUICK_STEPS, QUICK_STEP_TIME_S = 40, 0.01
# Emulated compute per inner step: every step is padded to it. The bench model's real step is ~15 ms with four
# learners on two cores, so 40 ms leaves room for contention; the default cap scales with it (the paper's
# ratio).
STEP_TIME_S = 0.04


def parse_cap_factors(text: str) -> tuple[float, ...]:
    """`--caps 1,2,0.5` -> (1.0, 2.0, 0.5); ConfigError naming the bad part."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--caps must be comma-separated numbers (e.g. 1,2,0.5), got {text!r}") from None


def dp_curve(cfg: Config, held: HeldOut, steps: int, every: int) -> list[tuple[int, float]]:
    """Data-parallel at equal tokens (one model, batch M x B, AdamW every step): (step, held-out loss)."""
    corpus = load_corpus(cfg.data)
    model = build_model(cfg.model, seed=cfg.data.seed)
    trainer = InnerTrainer(model, cfg.inner)
    sampler = ShardSampler(corpus.train, 0, 1, cfg.run.num_learners * cfg.data.batch_size, cfg.model.ctx_len,
                           cfg.data.seed)
    curve = [(0, evaluate(model, held.batches))]
    for s in range(1, steps + 1):
        trainer.train_step(*sampler.next_batch())
        if s % every == 0 or s == steps:
            curve.append((s, evaluate(model, held.batches)))
    return curve


def allreduce_s(num_bytes: float, link: LinkSpec, num_learners: int) -> float:
    """A ring all-reduce of `num_bytes` per learner over `link`: 2(M-1)/M x bytes / rate, plus 2(M-1)
    one-way hops of half a round trip each."""
    rate = min(link.up_bytes_per_s, link.down_bytes_per_s)
    return allreduce_bytes_per_step(1, num_learners, num_bytes) / rate + (num_learners - 1) * link.rtt_s


def first_below(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first time (or step) at which the loss is at or below `target`; None if never."""
    return next((t for t, loss in curve if loss <= target), None)


def default_cap_mb_s(num_params: int, num_learners: int, step_time_s: float) -> float:
    """The cap at which DP's all-reduce of fp32 gradients takes COMM_OVER_COMPUTE x its compute per step."""
    return allreduce_bytes_per_step(num_params, num_learners) / (COMM_OVER_COMPUTE * step_time_s) / 1e6


def _per_learner(result: WanResult, key: str) -> float:
    return sum(r.link[key] for r in result.learners) / len(result.learners)


def _engine_entry(result: WanResult, target: float) -> dict[str, Any]:
    from diloco.bench._wan_real import kernel_fields

    busy = [r.busy for r in result.learners]
    return {**kernel_fields(result),
        "time_to_target_s": first_below(result.curve, target), "final_loss": result.final_loss,
        "wall_s": result.wall_s, "versions": result.versions,
        "bytes_sent_per_learner": _per_learner(result, "bytes_up"),
        "bytes_received_per_learner": _per_learner(result, "bytes_down"),
        "delta_bytes_sent_per_learner": sum(r.sent.get("delta", 0) for r in result.learners) / len(busy),
        "global_bytes_received_per_learner": sum(r.received.get("global",
                                                                0) for r in result.learners) / len(busy),
        "busy_mean": sum(busy) / len(busy), "busy_min": min(busy), "busy_per_learner": busy,
        "step_s_mean": sum(r.compute_s for r in result.learners) / sum(r.steps for r in result.learners),
        "real_step_s_mean": sum(r.real_compute_s for r in result.learners)
                            / sum(r.steps for r in result.learners),
        "installs_per_learner": [r.installs for r in result.learners],
        "steps_over_pad": sum(r.steps_over_pad for r in result.learners)
                          / sum(r.steps for r in result.learners),
        "requests_per_learner": sum(r.link["requests"] for r in result.learners) / len(busy),
        "curve": [[round(t, 3), loss] for t, loss in result.curve], **result.extra,
    }


def _dp_entry(curve: list[tuple[int, float]], step_s: float, comm_s: float, steps: int, num_params: int,
              num_learners: int, target: float) -> dict[str, Any]:
    per_step = step_s + comm_s
    timed = [(s * per_step, loss) for s, loss in curve]
    traffic = steps * allreduce_bytes_per_step(num_params, num_learners)
    return {"time_to_target_s": first_below(timed, target), "final_loss": curve[-1][1],
            "wall_s": steps * per_step,
            "step_s": per_step, "compute_s_per_step": step_s, "allreduce_s_per_step": comm_s,
            "busy_mean": step_s / per_step, "bytes_sent_per_learner": traffic,
            "bytes_received_per_learner": traffic,
            "curve": [[round(t, 3), loss] for t, loss in timed], "modelled": True}


def diloco_steps(steps: int, tokens_factor: float, steps_per_phase: int) -> int:
    """Inner steps per learner of the DiLoCo methods: F x data-parallel's, rounded to whole phases (the factor
    run is this / steps, recorded as such)."""
    if not 1.0 <= tokens_factor <= 10.0:
        raise ConfigError(f"--tokens-factor must be between 1 and 10, got {tokens_factor:g}")
    return max(1, round(steps * tokens_factor / steps_per_phase)) * steps_per_phase


def speedups(dp_s: float | None, decoupled_s: float | None, tokens_factor: float) -> dict[str, float | None]:
    """DP's time to target / decoupled's: the issue's speedup_vs_dp at equal tokens, or, when the DiLoCo
    methods trained F != 1 times DP's tokens, speedup_vs_dp_past_equal_tokens (the other one null)."""
    speedup = dp_s / decoupled_s if dp_s and decoupled_s else None
    equal = tokens_factor == 1.0
    return {"speedup_vs_dp": speedup if equal else None,
            "speedup_vs_dp_past_equal_tokens": None if equal else speedup}


def _row(cap_mb_s: float, link: LinkSpec, dp: list[tuple[int, float]], runs: dict[str, WanResult],
         peer: dict[str, Any] | None, steps: int, num_params: int, num_learners: int,
         tokens_factor: float = 1.0, cap_factor: float = 1.0, real: dict[str, Any] | None = None) -> dict[str,
                                                                                                          Any]:
    """One cap's row; `real`: DP as measured over real links ({"measured", "compute_step_s", "cut"}), the
    traffic ratios then from the kernel's counters."""
    from diloco.bench import _wan_real

    target = dp[-1][1] * TARGET_OVER_DP
    methods = {name: _engine_entry(r, target) for name, r in runs.items()}
    dec = methods["decoupled"]
    dp_step_s = dec["step_s_mean"]  # DP computes the same per-site batch on the same (emulated) hardware
    if real is None:
        methods["dp"] = _dp_entry(dp, dp_step_s, allreduce_s(4.0 * num_params, link, num_learners), steps,
                                  num_params, num_learners, target)
    else:
        methods["dp"] = _wan_real.dp_entry(dp, real["measured"], real["compute_step_s"], steps, target)
    if peer is not None:
        from diloco.bench.peer_torchft import wan_entry

        methods["torchft_diloco"] = wan_entry(peer, dp_step_s, link, num_learners, target)
    order = ["dp", "sync_diloco", "decoupled", "torchft_diloco"]
    methods = {k: methods[k] for k in order if k in methods}
    ttt = {k: v["time_to_target_s"] for k, v in methods.items()}
    dp_m = methods["dp"]
    counted = "kernel_bytes_{}_per_learner" if real is not None else "bytes_{}_per_learner"
    return {
        "link_mode": "modelled" if real is None else "real",
        "link_mb_s": cap_mb_s, "cap_factor": cap_factor, "rtt_s": link.rtt_s if real is None else None,
        "target_loss": target, "tokens_factor": tokens_factor,
        "time_to_target_s": ttt, **speedups(ttt["dp"], ttt["decoupled"], tokens_factor),
        "dp_step_s_measured": dp_m["step_s"] if real is not None else None,
        "traffic_ratio_vs_dp": {way: dp_m[counted.format(way)] / dec[counted.format(way)]
                                for way in ("sent", "received")},
        # every object (deltas, the checkpoint's pointer and moments, statuses, manifests, updates, listings)
        "traffic_counted_by": "kernel (veth counters)" if real is not None else
                              "application: every object and listing",
        "delta_traffic_ratio_vs_dp": (dp_m[counted.format("sent")] / dec["delta_bytes_sent_per_learner"]
                                      if dec.get("delta_bytes_sent_per_learner") else None),
        "final_loss": {k: v["final_loss"] for k, v in methods.items()},
        "busy": {k: v["busy_mean"] for k, v in methods.items()}, "decoupled_busy_min": dec["busy_min"],
        "methods": methods,
    }




@benchmark(config="bench", quick="Smoke run: H=10, 40 steps, 10 ms steps.")
def bench_wan(
    config: str = "bench",
    quick: bool = False,
    link_mb_s: Annotated[float | None, Opt("--link-mb-s", min=1e-6, help=(
        "Cap per learner link, MB/s each way (default: the cap at which DP's all-reduce takes 39.6x its "
        "compute, the paper's ratio)."))] = None,
    steps: Annotated[int | None, Opt("--steps", min=1, help="Inner steps per learner (default: the "
                                                            "recipe's).")] = None,
    step_time_s: Annotated[float | None, Opt("--step-time-s", min=1e-4, help=(
        "Emulated compute per inner step (each step is padded to it; default 0.04 s). With --links real "
        "(default there: unpadded): every DiLoCo inner step and data-parallel's compute padded to it."))] \
        = None,
    rtt_ms: Annotated[float, Opt("--rtt-ms", min=0.0, help="Round trip added to every store request.")] = 2.0,
    peer: Annotated[bool, Opt("--peer/--no-peer", help="Run torchft's DiLoCo too (skipped if not "
                                                       "installed).")] = True,
    seed: Annotated[int | None, Opt("--seed", help="Data seed (default: the recipe's).")] = None,
    tokens_factor: Annotated[float, Opt("--tokens-factor", help=(
        "DiLoCo methods train this many times DP's tokens (1-10; default 1: equal tokens), to time them to "
        "DP's target past equal tokens."))] = 1.0,
    caps: Annotated[str, Opt("--caps", help=(
        "The rows: caps as multiples of the paper-equivalent cap (or of --link-mb-s), comma-separated; the "
        "first is the headline."))] = ",".join(f"{f:g}" for f in CAP_FACTORS),
    cohorts: Annotated[bool, Opt("--cohorts/--in-step", help=(
        "Decoupled learners in two cohorts half a phase apart (quorum M/2), as bench quality's "
        "streaming-clock-int4 drives them, or every learner in step."))] = True,
    fragments: Annotated[int, Opt("--fragments", help=(
        "Decoupled learners stream this many fragments (each shipped every H steps, staggered, tau 2; one "
        "merger shard); 1: whole-model deltas."))] = 8,
    links: Annotated[str, Opt("--links", help=(
        "real: every learner and DP's gloo ranks in network namespaces behind tbf-capped veth links to a "
        "real S3 server (needs CAP_NET_ADMIN); modelled: a store wrapper delays requests, DP's time is "
        "computed."))] = "modelled",
    cut_s: Annotated[float, Opt("--cut-s", help=(
        "With --links real: learner 0's link goes down for this many seconds mid-run (first cap) and across "
        "DP's steps."))] = 0.0,
    s3_server: Annotated[str, Opt("--s3-server", help=(
        "With --links real: the S3 server on the host end, rclone (rclone serve s3, Go: pip install "
        "'diloco[links]'), moto (Python), or auto (rclone when installed)."))] = "auto",
) -> BenchResult:
    """Time to a target loss behind a capped link: DP, sync and decoupled DiLoCo, torchft; links modelled or
    real."""
    # `caps`: the rows, as multiples of the cap. The decoupled row is Decoupled DiLoCo as the paper runs it,
    # streaming: `fragments` fragments (tau = fragments.overlap_steps, merged by one shard, each learner's
    # lanes prefetched), and `cohorts`: the learners in two cohorts half a phase apart (fragments.cohorts 2,
    # quorum M/2) as bench quality's streaming-clock-int4 drives them. fragments 1: whole-model deltas
    # (cohorts then: the odd learners start with half a phase, no grace window), cohorts False: every learner
    # in step. `links` "real": every learner (and DP's ranks, over gloo) in a network namespace behind a
    # tbf-capped veth, the bucket on a real S3 server, compute unpadded, the cap from DP's measured compute
    # step; `cut_s` > 0 (real links only): learner 0's link goes down for that long mid-run in the first row,
    # and across DP's steps.
    cap_factors = parse_cap_factors(caps)
    pad_s = step_time_s if links == "real" else None  # real links: unpadded unless asked
    step_time_s = STEP_TIME_S if step_time_s is None else step_time_s
    torch.set_num_threads(1)
    cfg = load_config(config)
    steps = steps or cfg.inner.total_steps
    if quick:
        cfg, steps, step_time_s = cfg.with_overrides(QUICK), QUICK_STEPS, QUICK_STEP_TIME_S
    if seed is not None:
        cfg = cfg.with_overrides({"data.seed": seed})
    cfg = cfg.with_overrides({"inner.total_steps": steps})
    if steps % cfg.inner.steps_per_phase:
        raise ConfigError(f"--steps {steps} must be a multiple of inner.steps_per_phase "
                          f"({cfg.inner.steps_per_phase})")
    if step_time_s <= 0 or rtt_ms < 0:
        raise ConfigError("--step-time-s must be > 0 and --rtt-ms >= 0")
    if not 1 <= fragments <= 64:
        raise ConfigError(f"--fragments must be in [1, 64], got {fragments}")
    if not cap_factors or any(not 0 < f <= 100 for f in cap_factors):
        raise ConfigError(f"--caps must be one or more factors in (0, 100], got {list(cap_factors)}")
    check_links(links, cut_s)
    if links == "real":
        from diloco.bench._s3_server import server_kind

        server = server_kind(s3_server)
    d_steps = diloco_steps(steps, tokens_factor, cfg.inner.steps_per_phase)
    d_cfg = cfg.with_overrides({"inner.total_steps": d_steps})  # the DiLoCo methods' own length and schedule
    m, log = cfg.run.num_learners, (lambda s: print(s, file=sys.stderr, flush=True))
    num_params = sum(p.numel() for p in build_model(cfg.model).parameters())
    base_cap = link_mb_s or default_cap_mb_s(num_params, m, step_time_s)
    held, t_start = HeldOut(cfg, load_corpus(cfg.data)), time.time()
    log(f"bench wan: {num_params:,} params, M={m}, {steps} steps per learner"
        + (f" ({d_steps} for the DiLoCo methods)" if d_steps != steps else "")
        + (f", step {step_time_s * 1e3:g} ms, paper-equivalent cap {base_cap:.4g} MB/s, rtt {rtt_ms:g} ms"
           if links == "modelled" else ", real links: the cap from data-parallel's compute step measured on "
                                       "them"))
    # torchft's replicas (subprocesses) train beside data-parallel (this thread): neither is timed by the
    # wall clock (both are on a modelled time axis), and together they use both cores
    with ThreadPoolExecutor(1) as side:
        peer_future = side.submit(_peer, d_cfg, d_steps, step_time_s, log) if peer else None
        dp = dp_curve(cfg, held, steps, every=max(1, cfg.inner.steps_per_phase // 2))
        log(f"  dp: final {dp[-1][1]:.4f} ({time.time() - t_start:.0f}s)")
        peer_run, peer_skipped = peer_future.result() if peer_future else (None, "--no-peer")

    def rows_at(caps: list[float], real=None) -> list[dict[str, Any]]:
        rows = []
        for row, (factor, cap) in enumerate(zip(cap_factors, caps, strict=True)):
            link = LinkSpec.symmetric(cap, rtt_ms / 1e3)
            runs = {}
            for name, mode in (("sync_diloco", "sync"), ("decoupled", "carry")):
                run = WanRun(name, mode, link, step_time_s, d_steps, cohorts=cohorts and mode == "carry",
                             fragments=fragments if mode == "carry" else 1)
                if real is not None:
                    run = real.wan_run(run, row, cap, real.dp["compute_step_s"])
                runs[name] = run_wan(real_cfg if real is not None else d_cfg, run, held, cfg.data.seed)
                log(f"  {cap:.4g} MB/s {name}: final {runs[name].final_loss:.4f}, wall "
                    f"{runs[name].wall_s:.1f}s ({time.time() - t_start:.0f}s)")
            measured = None if real is None else {"measured": real.dp["rows"][row],
                                                  "compute_step_s": real.dp["compute_step_s"]}
            rows.append(_row(cap, link, dp, runs, peer_run, steps, num_params, m, d_steps / steps, factor,
                             measured))
            if real is not None and real.cut_s > 0 and row == 0:
                rows[-1]["cut"] = _cut_record(real, runs, rows[-1], d_cfg.inner.steps_per_phase)
        return rows

    links_record, model_record, record_step_s = None, None, step_time_s
    if links == "real":
        from diloco.bench._wan_real import REAL_PREFETCH, RealLinks, real_model

        real_cfg = d_cfg.with_overrides(REAL_PREFETCH)
        with RealLinks(m, server=server) as real:
            log(f"  links: tag {real.net.tag}, bridge {real.net.bridge} at {real.net.host_addr}, S3 "
                f"{real.endpoint}")
            # --quick: 4x the cap, as when modelled
            shrink = QUICK_STEP_TIME_S / STEP_TIME_S if quick else 1.0
            caps = real.measure(cfg, load_corpus(cfg.data), lambda compute_s: [
                (link_mb_s or default_cap_mb_s(num_params, m, compute_s * shrink)) * f for f in cap_factors],
                quick=quick, cut_s=cut_s, num_caps=len(cap_factors), pad_s=pad_s)
            base_cap = caps[0] / cap_factors[0]
            padded = "" if pad_s is None else f", padded to {real.dp['compute_step_s'] * 1e3:.1f} ms"
            log(f"  dp over the links: compute {real.dp['compute_step_s_measured'] * 1e3:.1f} ms a step"
                f"{padded}, caps "
                f"{', '.join(f'{c:.4g}' for c in caps)} MB/s ({time.time() - t_start:.0f}s)")
            rows = rows_at(caps, real)
            links_record = real.record()
            # the cap's arithmetic
            model_record, record_step_s = real_model(pad_s), real.dp["compute_step_s"] * shrink
    else:
        rows = rows_at([base_cap * f for f in cap_factors])
    record = config_record(cfg, steps, record_step_s, rtt_ms, num_params, base_cap, link_mb_s is None,
                           peer_run, time.time() - t_start)
    result = {**{k: v for k, v in rows[0].items() if k != "methods"}, "methods": rows[0]["methods"],
              "rows": rows, "targets": REAL_TARGETS if links == "real" else TARGETS, "config": record,
              "padded_step_s": pad_s}
    result["config"].update(link_mode=links, links=links_record)
    if model_record is not None:
        result["config"]["model"] = model_record
    result["config"].update(torchft_skipped=peer_skipped, tokens_factor_requested=tokens_factor,
                            cap_factors=list(cap_factors), decoupled_cohorts=cohorts,
                            decoupled_fragments=fragments, diloco_steps_per_learner=d_steps,
                            diloco_tokens_per_method=m * d_steps * cfg.data.batch_size * cfg.model.ctx_len)
    return shown(result)


def check_links(links: str, cut_s: float) -> None:
    """ConfigError (LinksUnavailable: no privilege) naming the flag, before anything runs."""
    if links not in ("modelled", "real"):
        raise ConfigError(f"--links must be 'real' or 'modelled', got {links!r}")
    if cut_s < 0 or (cut_s > 0 and links != "real"):
        raise ConfigError(f"--cut-s needs --links real and a number of seconds >= 0, got {cut_s:g} with "
                          f"{links}")
    if links == "real":
        from diloco.bench.links import check_privilege

        check_privilege()


def _cut_record(real, runs: dict[str, WanResult], row: dict[str, Any], h: int) -> dict[str, Any]:
    """The first row's cut: what it did to data-parallel (measured across its own steps) and to each DiLoCo
    row."""
    from diloco.bench._wan_real import cut_fields, dp_cut_fields

    return {"site": 0, "down_s": real.cut_s, "dp": dp_cut_fields(real.dp, row["dp_step_s_measured"]),
            **{name: cut_fields(result, h, real.cut_s) for name, result in runs.items()}}


def _peer(cfg: Config, steps: int, step_time_s: float, log) -> tuple[dict[str, Any] | None, str | None]:
    """torchft's DiLoCo on the same model and data, for the DiLoCo methods' tokens, or (None, why not)."""
    from diloco.bench.peer_torchft import PeerUnavailable, run_torchft

    try:
        run = run_torchft(cfg, steps, cfg.data.seed)
    except PeerUnavailable as err:
        log(f"  torchft_diloco: skipped: {err}")
        return None, str(err)
    log(f"  torchft_diloco: final {run['final_loss']:.4f} ({run['wall_s']:.0f}s)")
    return run, None

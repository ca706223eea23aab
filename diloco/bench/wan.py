"""`diloco bench wan`: wall-clock time to a target held-out loss when every learner's link to the bucket is
capped — data-parallel (modelled all-reduce), synchronous DiLoCo and Decoupled DiLoCo (real runs through
ThrottledStore), and torchft's DiLoCo (its loss measured, its all-reduce time modelled like DP's).

Contract: equal tokens for every method; prints a table per cap (the paper-equivalent cap X, 2X, X/2) and
writes JSON {"link_mb_s", "target_loss", "time_to_target_s": {...}, "speedup_vs_dp", "traffic_ratio_vs_dp":
{"sent", "received"}, "final_loss": {...}, "busy", "tokens_factor", "speedup_vs_dp_past_equal_tokens",
"rows": [...], "config"}; targets are reported, never assumed. What is modelled and what is measured is
written into the JSON ("model"). With `tokens_factor` F > 1 the DiLoCo methods (torchft's too) train F x
data-parallel's tokens, their schedules over that length: their time to data-parallel's target is then
measured past equal tokens, reported as speedup_vs_dp_past_equal_tokens, and speedup_vs_dp (equal tokens)
is null. `--links real` (bench/_wan_real.py) runs every learner and data-parallel's gloo ranks in network namespaces
behind tbf-capped veth links to a real S3 server, unpadded; the JSON then says "link_mode": "real", counts bytes
with the kernel (kernel_bytes_sent/received per learner) and times DP for real (dp_step_s_measured). Modelled
links count every byte through them (every object and listing, the bucket checkpoint at the engine's
defaults); "delta_traffic_ratio_vs_dp" beside is the deltas alone.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from diloco.bench._quality_runs import HeldOut
from diloco.bench._wan_runs import WanResult, WanRun, run_wan
from diloco.bench.bandwidth import allreduce_bytes_per_step
from diloco.configs import Config, ConfigError, load_config
from diloco.specs.gpt import load_corpus
from diloco.bench.throttle import LinkSpec
from diloco.training.data import ShardSampler
from diloco.training.inner import InnerTrainer, evaluate
from diloco.training.model import build_model

# The paper's setting: data-parallel needs ~198 Gbps per site to keep up, the links have 5 Gbps (Decoupled
# DiLoCo blog; ALGORITHM.md), so each step's all-reduce would take 198 / 5 = 39.6 times its compute.
PAPER_NEEDED_GBPS, PAPER_LINK_GBPS = 198.0, 5.0
COMM_OVER_COMPUTE = PAPER_NEEDED_GBPS / PAPER_LINK_GBPS
TARGET_OVER_DP = 1.02  # the target loss: data-parallel's final held-out loss x this
TARGETS = {"speedup_vs_dp_min": 20.0, "decoupled_busy_min": 0.95}
# --links real (issue #43): busy on real compute, traffic counted by the kernel, both ways
REAL_TARGETS = {"speedup_vs_dp_min": 20.0, "decoupled_busy_min": 0.90, "traffic_ratio_vs_dp_min": 400.0}
CAP_FACTORS = (1.0, 2.0, 0.5)  # rows: the paper-equivalent cap, twice it, half of it
QUICK = {"inner.steps_per_phase": 10, "inner.warmup_steps": 5, "eval.num_batches": 2, "eval.batch_size": 16}
QUICK_STEPS, QUICK_STEP_TIME_S = 40, 0.01
# Emulated compute per inner step: every step is padded to it. The bench model's real step is ~15 ms with four
# learners on two cores, so 40 ms leaves room for contention; the default cap scales with it (the paper's ratio).
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
        "global_bytes_received_per_learner": sum(r.received.get("global", 0) for r in result.learners) / len(busy),
        "busy_mean": sum(busy) / len(busy), "busy_min": min(busy), "busy_per_learner": busy,
        "step_s_mean": sum(r.compute_s for r in result.learners) / sum(r.steps for r in result.learners),
        "real_step_s_mean": sum(r.real_compute_s for r in result.learners) / sum(r.steps for r in result.learners),
        "installs_per_learner": [r.installs for r in result.learners],
        "requests_per_learner": sum(r.link["requests"] for r in result.learners) / len(busy),
        "curve": [[round(t, 3), loss] for t, loss in result.curve], **result.extra,
    }


def _dp_entry(curve: list[tuple[int, float]], step_s: float, comm_s: float, steps: int, num_params: int,
              num_learners: int, target: float) -> dict[str, Any]:
    per_step = step_s + comm_s
    timed = [(s * per_step, loss) for s, loss in curve]
    traffic = steps * allreduce_bytes_per_step(num_params, num_learners)
    return {"time_to_target_s": first_below(timed, target), "final_loss": curve[-1][1], "wall_s": steps * per_step,
            "step_s": per_step, "compute_s_per_step": step_s, "allreduce_s_per_step": comm_s,
            "busy_mean": step_s / per_step, "bytes_sent_per_learner": traffic, "bytes_received_per_learner": traffic,
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
         tokens_factor: float = 1.0, cap_factor: float = 1.0, real: dict[str, Any] | None = None) -> dict[str, Any]:
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


def _print_rows(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    factor, real = rows[0]["tokens_factor"], rows[0]["link_mode"] == "real"
    past = f"; DiLoCo methods train {factor:.3g}x data-parallel's tokens" if factor != 1.0 else ""
    how = "; real links, bytes counted by the kernel" if real else ""
    table = Table(title=f"time to target held-out loss behind a capped link (per learner, each way){past}{how}")
    for col in ("cap MB/s", "method", "time to target s", "final nats/byte", "wall s", "busy", "sent MB",
                "recv MB", "vs DP: speedup / sent / recv"):
        table.add_column(col, justify="right")
    for row in rows:
        for name, m in row["methods"].items():
            ttt = m["time_to_target_s"]
            vs = ""
            if name == "decoupled":
                sp = row["speedup_vs_dp"] or row["speedup_vs_dp_past_equal_tokens"]
                vs = (f"{sp:.1f}x" if sp else "-") + f" / {row['traffic_ratio_vs_dp']['sent']:.0f}x" \
                     f" / {row['traffic_ratio_vs_dp']['received']:.0f}x"
            counted = "kernel_bytes_{}_per_learner" if real and m.get("kernel_bytes_sent") else "bytes_{}_per_learner"
            table.add_row(f"{row['link_mb_s']:.4g}", name + (" (modelled)" if m.get("modelled") else ""),
                          "never" if ttt is None else f"{ttt:.1f}", f"{m['final_loss']:.4f}", f"{m['wall_s']:.1f}",
                          f"{m['busy_mean']:.3f}", f"{m[counted.format('sent')] / 1e6:.2f}",
                          f"{m[counted.format('received')] / 1e6:.2f}", vs)
        table.add_section()
    Console().print(table)
    head = rows[0]
    if factor == 1.0:
        speed = (f"speedup_vs_dp {head['speedup_vs_dp'] and round(head['speedup_vs_dp'], 1)} "
                 f"(target >= {TARGETS['speedup_vs_dp_min']:g})")
    else:
        past_s = head["speedup_vs_dp_past_equal_tokens"]
        speed = (f"speedup past equal tokens (DiLoCo at {factor:.3g}x DP's tokens) "
                 f"{past_s and round(past_s, 1)}; speedup_vs_dp (equal tokens) not measured by this run")
    where = "the" if head["cap_factor"] == 1.0 else f"{head['cap_factor']:g}x the"
    targets = REAL_TARGETS if real else TARGETS
    Console().print(f"target {head['target_loss']:.4f} nats/byte (DP final x {TARGET_OVER_DP}); at {where} "
                    f"paper-equivalent cap {head['link_mb_s']:.4g} MB/s: {speed}, decoupled busy min "
                    f"{head['decoupled_busy_min']:.3f} (target >= {targets['decoupled_busy_min']})")
    if real:
        dec, dp_m = head["methods"]["decoupled"], head["methods"]["dp"]
        Console().print(f"real links: DP step {head['dp_step_s_measured']:.3f} s measured over gloo "
                        f"(compute {dp_m['compute_s_per_step'] * 1e3:.1f} ms); decoupled per learner: kernel "
                        f"{dec['kernel_bytes_sent_per_learner'] / 1e6:.2f} / {dec['kernel_bytes_received_per_learner'] / 1e6:.2f}"
                        f" MB sent / received, application {dec['bytes_sent_per_learner'] / 1e6:.2f} / "
                        f"{dec['bytes_received_per_learner'] / 1e6:.2f} MB in {sum(dec['requests']) / len(dec['requests']):.0f}"
                        f" requests; traffic vs DP (kernel) {head['traffic_ratio_vs_dp']['sent']:.0f}x / "
                        f"{head['traffic_ratio_vs_dp']['received']:.0f}x (target >= {targets['traffic_ratio_vs_dp_min']:g}x)")
        if head.get("cut"):
            cut = head["cut"]
            Console().print(f"cut: learner 0's link down {cut['down_s']:g} s: DP lost "
                            f"{cut['dp']['stall_s']:.1f} s; steps computed while down per learner: decoupled "
                            f"{cut['decoupled']['steps_during_cut']}, sync_diloco {cut['sync_diloco']['steps_during_cut']}")


def bench_wan(json_path: Path | None = None, link_mb_s: float | None = None, steps: int | None = None,
              step_time_s: float = STEP_TIME_S, rtt_ms: float = 2.0, config: str = "bench", quick: bool = False,
              peer: bool = True, seed: int | None = None, tokens_factor: float = 1.0,
              cap_factors: tuple[float, ...] = CAP_FACTORS, cohorts: bool = True,
              fragments: int = 8, links: str = "modelled", cut_s: float = 0.0) -> dict[str, Any]:
    """DP (modelled), sync DiLoCo and Decoupled DiLoCo (real), torchft DiLoCo (peer) behind capped links.
    `cap_factors`: the rows, as multiples of the cap. The decoupled row is Decoupled DiLoCo as the paper runs it,
    streaming: `fragments` fragments (tau = fragments.overlap_steps, merged by one shard, each learner's lanes
    prefetched), and `cohorts`: the learners in two cohorts half a phase apart (fragments.cohorts 2, quorum M/2)
    as bench quality's streaming-clock-int4 drives them. fragments 1: whole-model deltas (cohorts then: the odd
    learners start with half a phase, no grace window), cohorts False: every learner in step.
    `links` "real": every learner (and DP's ranks, over gloo) in a network namespace behind a tbf-capped veth, the
    bucket on a real S3 server, compute unpadded, the cap from DP's measured compute step; `cut_s` > 0 (real links
    only): learner 0's link goes down for that long mid-run in the first row, and across DP's steps."""
    torch.set_num_threads(1)
    cfg = load_config(config)
    steps = steps or cfg.inner.total_steps
    if quick:
        cfg, steps, step_time_s = cfg.with_overrides(QUICK), QUICK_STEPS, QUICK_STEP_TIME_S
    if seed is not None:
        cfg = cfg.with_overrides({"data.seed": seed})
    cfg = cfg.with_overrides({"inner.total_steps": steps})
    if steps % cfg.inner.steps_per_phase:
        raise ConfigError(f"--steps {steps} must be a multiple of inner.steps_per_phase ({cfg.inner.steps_per_phase})")
    if step_time_s <= 0 or rtt_ms < 0:
        raise ConfigError("--step-time-s must be > 0 and --rtt-ms >= 0")
    if not 1 <= fragments <= 64:
        raise ConfigError(f"--fragments must be in [1, 64], got {fragments}")
    if not cap_factors or any(not 0 < f <= 100 for f in cap_factors):
        raise ConfigError(f"--caps must be one or more factors in (0, 100], got {list(cap_factors)}")
    check_links(links, cut_s)
    d_steps = diloco_steps(steps, tokens_factor, cfg.inner.steps_per_phase)
    d_cfg = cfg.with_overrides({"inner.total_steps": d_steps})  # the DiLoCo methods' own length and schedule
    m, log = cfg.run.num_learners, (lambda s: print(s, file=sys.stderr, flush=True))
    num_params = sum(p.numel() for p in build_model(cfg.model).parameters())
    base_cap = link_mb_s or default_cap_mb_s(num_params, m, step_time_s)
    held, t_start = HeldOut(cfg, load_corpus(cfg.data)), time.time()
    log(f"bench wan: {num_params:,} params, M={m}, {steps} steps per learner"
        + (f" ({d_steps} for the DiLoCo methods)" if d_steps != steps else "")
        + (f", step {step_time_s * 1e3:g} ms, paper-equivalent cap {base_cap:.4g} MB/s, rtt {rtt_ms:g} ms"
           if links == "modelled" else ", real links: the cap from data-parallel's compute step measured on them"))
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
                log(f"  {cap:.4g} MB/s {name}: final {runs[name].final_loss:.4f}, wall {runs[name].wall_s:.1f}s "
                    f"({time.time() - t_start:.0f}s)")
            measured = None if real is None else {"measured": real.dp["rows"][row],
                                                  "compute_step_s": real.dp["compute_step_s"]}
            rows.append(_row(cap, link, dp, runs, peer_run, steps, num_params, m, d_steps / steps, factor, measured))
            if real is not None and real.cut_s > 0 and row == 0:
                rows[-1]["cut"] = _cut_record(real, runs, rows[-1], d_cfg.inner.steps_per_phase)
        return rows

    links_record, model_record, record_step_s = None, None, step_time_s
    if links == "real":
        from diloco.bench._wan_real import REAL_MODEL, REAL_PREFETCH_POLL_S, RealLinks

        real_cfg = d_cfg.with_overrides({"learner.prefetch_poll_s": REAL_PREFETCH_POLL_S})
        with RealLinks(m) as real:
            log(f"  links: tag {real.net.tag}, bridge {real.net.bridge} at {real.net.host_addr}, S3 {real.endpoint}")
            shrink = QUICK_STEP_TIME_S / STEP_TIME_S if quick else 1.0  # --quick: 4x the cap, as when modelled
            caps = real.measure(cfg, load_corpus(cfg.data), lambda compute_s: [
                (link_mb_s or default_cap_mb_s(num_params, m, compute_s * shrink)) * f for f in cap_factors],
                quick=quick, cut_s=cut_s, num_caps=len(cap_factors))
            base_cap = caps[0] / cap_factors[0]
            log(f"  dp over the links: compute {real.dp['compute_step_s'] * 1e3:.1f} ms a step, caps "
                f"{', '.join(f'{c:.4g}' for c in caps)} MB/s ({time.time() - t_start:.0f}s)")
            rows = rows_at(caps, real)
            links_record = real.record()
            model_record, record_step_s = REAL_MODEL, real.dp["compute_step_s"] * shrink  # the cap's arithmetic
    else:
        rows = rows_at([base_cap * f for f in cap_factors])
    result = {**{k: v for k, v in rows[0].items() if k != "methods"}, "methods": rows[0]["methods"], "rows": rows,
              "targets": REAL_TARGETS if links == "real" else TARGETS, "config": _config_record(cfg, steps, record_step_s, rtt_ms, num_params, base_cap,
                                                             link_mb_s is None, peer_run, time.time() - t_start)}
    result["config"].update(link_mode=links, links=links_record)
    if model_record is not None:
        result["config"]["model"] = model_record
    result["config"].update(torchft_skipped=peer_skipped, tokens_factor_requested=tokens_factor,
                            cap_factors=list(cap_factors), decoupled_cohorts=cohorts, decoupled_fragments=fragments,
                            diloco_steps_per_learner=d_steps,
                            diloco_tokens_per_method=m * d_steps * cfg.data.batch_size * cfg.model.ctx_len)
    _print_rows(rows)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def check_links(links: str, cut_s: float) -> None:
    """ConfigError (LinksUnavailable: no privilege) naming the flag, before anything runs."""
    if links not in ("modelled", "real"):
        raise ConfigError(f"--links must be 'real' or 'modelled', got {links!r}")
    if cut_s < 0 or (cut_s > 0 and links != "real"):
        raise ConfigError(f"--cut-s needs --links real and a number of seconds >= 0, got {cut_s:g} with {links}")
    if links == "real":
        from diloco.bench.links import check_privilege

        check_privilege()


def _cut_record(real, runs: dict[str, WanResult], row: dict[str, Any], h: int) -> dict[str, Any]:
    """The first row's cut: what it did to data-parallel (measured across its own steps) and to each DiLoCo row."""
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


def _config_record(cfg: Config, steps: int, step_time_s: float, rtt_ms: float, num_params: int, base_cap: float,
                   cap_is_default: bool, peer_run, wall_s: float) -> dict[str, Any]:
    m = cfg.run.num_learners
    dp_bytes = allreduce_bytes_per_step(num_params, m)
    return {
        "recipe": cfg.name, "num_learners": m, "num_params": num_params, "steps_per_learner": steps,
        "inner_steps_per_phase": cfg.inner.steps_per_phase, "batch_size": cfg.data.batch_size,
        "ctx_len": cfg.model.ctx_len, "tokens_per_method": m * steps * cfg.data.batch_size * cfg.model.ctx_len,
        "seed": cfg.data.seed, "step_time_s": step_time_s, "rtt_ms": rtt_ms, "codec": cfg.learner.codec,
        "update_codec": cfg.outer.update_codec, "outer": cfg.outer.model_dump(), "wall_s": wall_s,
        "cap": {"mb_s": base_cap, "default": cap_is_default, "comm_over_compute": COMM_OVER_COMPUTE,
                "dp_allreduce_bytes_per_step": dp_bytes,
                "arithmetic": f"DP all-reduce per step = 2(M-1)/M x 4 B x {num_params:,} = {dp_bytes:,.0f} B; "
                              f"{PAPER_NEEDED_GBPS:g} Gbps needed / {PAPER_LINK_GBPS:g} Gbps available = "
                              f"{COMM_OVER_COMPUTE:.1f} x compute; cap = {dp_bytes:,.0f} B / ({COMM_OVER_COMPUTE:.1f} x "
                              f"{step_time_s:g} s) = {dp_bytes / (COMM_OVER_COMPUTE * step_time_s) / 1e6:.4g} MB/s"},
        "torchft": None if peer_run is None else {k: v for k, v in peer_run.items() if k != "curve"},
        "model": {
            "measured": "sync_diloco and decoupled: real learner processes, every store request through a "
                        "ThrottledStore (cap each way, FIFO, rtt per request); held-out loss of every committed "
                        "version at its commit time; bytes each learner's link carried after its join",
            "emulated": f"compute: every inner step padded to {step_time_s:g} s (the rest slept), so M learners "
                        "on a shared 2-core box compute at one fixed speed; real step times are in real_step_s_mean",
            "modelled": "dp: measured loss per step (batch M x B, one AdamW step per step) on a time axis of "
                        "(decoupled learners' measured step time + ring all-reduce of fp32 gradients at the cap: "
                        "2(M-1)/M x 4N / cap + (M-1) x rtt) per step; torchft_diloco: its measured loss per sync "
                        "on a time axis of its steps x the same step time + per sync its measured all-reduce "
                        "payload as a ring all-reduce at the cap",
            "tokens": "data-parallel trains tokens_per_method; sync_diloco, decoupled and torchft_diloco "
                      "train diloco_tokens_per_method (tokens_factor x it, schedules over that length)",
            "schedules": "sync_diloco: learner.mode sync, quorum M, learners wait for each version; decoupled: "
                         "the recipe as shipped (carry mode, its quorum and grace window, its learner.prefetch), "
                         "learners never wait",
        },
    }

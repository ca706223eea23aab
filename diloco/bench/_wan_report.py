"""What `bench wan` shows and records beside its rows: the paper's setting and the targets, the table and the
summary lines, and the "config" record of the JSON (the cap's arithmetic, what is modelled and measured).

Contract: pure functions of the rows and the run's settings; nothing here runs or measures anything.
"""

from __future__ import annotations

from typing import Any

from diloco.bench.bandwidth import allreduce_bytes_per_step
from diloco.bench.harness import BenchResult, Table
from diloco.configs import Config

# The paper's setting: data-parallel needs ~198 Gbps per site to keep up, the links have 5 Gbps (Decoupled
# DiLoCo blog; ALGORITHM.md), so each step's all-reduce would take 198 / 5 = 39.6 times its compute.
PAPER_NEEDED_GBPS, PAPER_LINK_GBPS = 198.0, 5.0
COMM_OVER_COMPUTE = PAPER_NEEDED_GBPS / PAPER_LINK_GBPS
TARGET_OVER_DP = 1.02  # the target loss: data-parallel's final held-out loss x this
TARGETS = {"speedup_vs_dp_min": 20.0, "decoupled_busy_min": 0.95}
# --links real (issue #43): busy on real compute, traffic counted by the kernel, both ways
REAL_TARGETS = {"speedup_vs_dp_min": 20.0, "decoupled_busy_min": 0.90, "traffic_ratio_vs_dp_min": 400.0}


def shown(result: dict[str, Any]) -> BenchResult:
    """The rows as one table (a section per cap), then the headline row's figures against the targets."""
    rows = result["rows"]
    factor, real = rows[0]["tokens_factor"], rows[0]["link_mode"] == "real"
    past = f"; DiLoCo methods train {factor:.3g}x data-parallel's tokens" if factor != 1.0 else ""
    how = "; real links, bytes counted by the kernel" if real else ""
    table = Table(f"time to target held-out loss behind a capped link (per learner, each way){past}{how}",
                  ["cap MB/s", "method", "time to target s", "final nats/byte", "wall s", "busy", "sent MB",
                   "recv MB", "vs DP: speedup / sent / recv"])
    for row in rows:
        for name, m in row["methods"].items():
            ttt = m["time_to_target_s"]
            vs = ""
            if name == "decoupled":
                sp = row["speedup_vs_dp"] or row["speedup_vs_dp_past_equal_tokens"]
                vs = (f"{sp:.1f}x" if sp else "-") + f" / {row['traffic_ratio_vs_dp']['sent']:.0f}x" \
                     f" / {row['traffic_ratio_vs_dp']['received']:.0f}x"
            kernel = real and m.get("kernel_bytes_sent")
            counted = "kernel_bytes_{}_per_learner" if kernel else "bytes_{}_per_learner"
            table.rows.append([f"{row['link_mb_s']:.4g}", name + (" (modelled)" if m.get("modelled") else ""),
                               "never" if ttt is None else f"{ttt:.1f}", f"{m['final_loss']:.4f}",
                               f"{m['wall_s']:.1f}", f"{m['busy_mean']:.3f}",
                               f"{m[counted.format('sent')] / 1e6:.2f}",
                               f"{m[counted.format('received')] / 1e6:.2f}", vs])
        table.rows.append(None)
    return BenchResult(result, [table], _notes(rows[0], factor, real, result.get("padded_step_s")))


def _notes(head: dict[str, Any], factor: float, real: bool, pad_s: float | None = None) -> list[str]:
    if factor == 1.0:
        speed = (f"speedup_vs_dp {head['speedup_vs_dp'] and round(head['speedup_vs_dp'], 1)} "
                 f"(target >= {TARGETS['speedup_vs_dp_min']:g})")
    else:
        past_s = head["speedup_vs_dp_past_equal_tokens"]
        speed = (f"speedup past equal tokens (DiLoCo at {factor:.3g}x DP's tokens) "
                 f"{past_s and round(past_s, 1)}; speedup_vs_dp (equal tokens) not measured by this run")
    where = "the" if head["cap_factor"] == 1.0 else f"{head['cap_factor']:g}x the"
    targets = REAL_TARGETS if real else TARGETS
    notes = [f"target {head['target_loss']:.4f} nats/byte (DP final x {TARGET_OVER_DP}); at {where} "
             f"paper-equivalent cap {head['link_mb_s']:.4g} MB/s: {speed}, decoupled busy min "
             f"{head['decoupled_busy_min']:.3f} (target >= {targets['decoupled_busy_min']})"]
    if real:
        dec, dp_m = head["methods"]["decoupled"], head["methods"]["dp"]
        ratio = head["traffic_ratio_vs_dp"]
        padded = "" if pad_s is None else (
            f"; every DiLoCo step and DP's compute padded to {pad_s * 1e3:g} ms (decoupled's real steps "
            f"{dec['real_step_s_mean'] * 1e3:.1f} ms, {dec['steps_over_pad']:.1%} over the pad)")
        notes.append(f"real links: DP step {head['dp_step_s_measured']:.3f} s measured over gloo (compute "
                     f"{dp_m['compute_s_per_step'] * 1e3:.1f} ms){padded}; decoupled per learner: kernel "
                     f"{dec['kernel_bytes_sent_per_learner'] / 1e6:.2f} / "
                     f"{dec['kernel_bytes_received_per_learner'] / 1e6:.2f} MB sent / received, application "
                     f"{dec['bytes_sent_per_learner'] / 1e6:.2f} / "
                     f"{dec['bytes_received_per_learner'] / 1e6:.2f} MB in "
                     f"{sum(dec['requests']) / len(dec['requests']):.0f} requests; traffic vs DP (kernel) "
                     f"{ratio['sent']:.0f}x / {ratio['received']:.0f}x (target >= "
                     f"{targets['traffic_ratio_vs_dp_min']:g}x)")
        if head.get("cut"):
            cut = head["cut"]
            notes.append(f"cut: learner 0's link down {cut['down_s']:g} s: DP lost "
                         f"{cut['dp']['stall_s']:.1f} s; steps computed while down per learner: decoupled "
                         f"{cut['decoupled']['steps_during_cut']}, sync_diloco "
                         f"{cut['sync_diloco']['steps_during_cut']}")
    return notes


def config_record(cfg: Config, steps: int, step_time_s: float, rtt_ms: float, num_params: int,
                  base_cap: float,
                   cap_is_default: bool, peer_run, wall_s: float) -> dict[str, Any]:
    m = cfg.run.num_learners
    dp_bytes = allreduce_bytes_per_step(num_params, m)
    return {
        "recipe": cfg.name, "num_learners": m, "num_params": num_params, "steps_per_learner": steps,
        "inner_steps_per_phase": cfg.inner.steps_per_phase, "batch_size": cfg.data.batch_size,
        "ctx_len": cfg.model.ctx_len,
            "tokens_per_method": m * steps * cfg.data.batch_size * cfg.model.ctx_len,
        "seed": cfg.data.seed, "step_time_s": step_time_s, "rtt_ms": rtt_ms, "codec": cfg.learner.codec,
        "update_codec": cfg.outer.update_codec, "outer": cfg.outer.model_dump(), "wall_s": wall_s,
        "cap": {"mb_s": base_cap, "default": cap_is_default, "comm_over_compute": COMM_OVER_COMPUTE,
                "dp_allreduce_bytes_per_step": dp_bytes,
                "arithmetic": f"DP all-reduce per step = 2(M-1)/M x 4 B x {num_params:,} = "
                              f"{dp_bytes:,.0f} B; "
                              f"{PAPER_NEEDED_GBPS:g} Gbps needed / {PAPER_LINK_GBPS:g} Gbps available = "
                              f"{COMM_OVER_COMPUTE:.1f} x compute; cap = {dp_bytes:,.0f} B / "
                              f"({COMM_OVER_COMPUTE:.1f} x {step_time_s:g} s) = "
                              f"{dp_bytes / (COMM_OVER_COMPUTE * step_time_s) / 1e6:.4g} MB/s"},
        "torchft": None if peer_run is None else {k: v for k, v in peer_run.items() if k != "curve"},
        "model": {
            "measured": "sync_diloco and decoupled: real learner processes, every store request through a "
                        "ThrottledStore (cap each way, FIFO, rtt per request); held-out loss of every "
                        "committed version at its commit time; bytes each learner's link carried after its "
                        "join",
            "emulated": f"compute: every inner step padded to {step_time_s:g} s (the rest slept), so M "
                        "learners on a shared 2-core box compute at one fixed speed; real step times are in "
                        "real_step_s_mean",
            "modelled": "dp: measured loss per step (batch M x B, one AdamW step per step) on a time axis of "
                        "(decoupled learners' measured step time + ring all-reduce of fp32 gradients at the "
                        "cap: 2(M-1)/M x 4N / cap + (M-1) x rtt) per step; torchft_diloco: its measured loss "
                        "per sync on a time axis of its steps x the same step time + per sync its measured "
                        "all-reduce payload as a ring all-reduce at the cap",
            "tokens": "data-parallel trains tokens_per_method; sync_diloco, decoupled and torchft_diloco "
                      "train diloco_tokens_per_method (tokens_factor x it, schedules over that length)",
            "schedules": "sync_diloco: learner.mode sync, quorum M, learners wait for each version; "
                         "decoupled: the recipe as shipped (carry mode, its quorum and grace window, its "
                         "learner.prefetch), learners never wait",
        },
    }

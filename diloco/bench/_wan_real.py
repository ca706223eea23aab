"""`bench wan --links real`: the links, the S3 server, data-parallel measured over gloo, and the rows' kernel
bytes.

Contract: `RealLinks(m, server=)` is a context manager holding a LinkNet of m sites, an S3 server (`server`:
rclone or moto, _s3_server.SERVERS) on the bridge's host address and a fresh bucket; `measure(...)` times
data-parallel over the links (bench/_dp_links.py) and fixes the rows' caps; `wan_run(run, row, cap)` turns a
modelled WanRun into the same run over the real links (its own prefix in the bucket, learner i in site i,
unpadded or, with `pad_s`, every inner step padded to pad_s as DP's compute is then; the link only counting
what the application sends); `dp_entry` and `kernel_fields` make the JSON's entries from what was measured.
DP's time to target is its steps to target on the uncapped curve (the same seed) x its step time measured over
the links: its loss per step does not depend on the link.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from typing import Any

from diloco.bench._dp_links import measure_dp
from diloco.bench._s3_server import SERVERS, cpu_s, new_bucket, s3_server
from diloco.bench._wan_runs import WanResult, WanRun
from diloco.bench.links import LinkNet, tbf_args
from diloco.bench.throttle import LinkSpec

# how learners look for new versions on a thin link, where each poll is an HTTP request of ~0.7 kB (SigV4
# headers) and its answer, which the modelled link did not charge: one GET of the merger's heads every 0.1 s
# wakes the lanes that moved; each lane polls its own chain only every 5 s (docs/bench/wan.md, "Real links")
REAL_PREFETCH = {"learner.prefetch_poll_s": 0.1, "learner.prefetch_idle_poll_s": 5.0}
# timed DP steps per cap: the mean is stable to ~2% here
DP_STEPS, DP_WARM_STEPS, DP_COMPUTE_STEPS = 20, 2, 10
QUICK_DP = {"steps": 3, "warm_steps": 1, "compute_steps": 3}

# what the JSON's config.model says in real mode (replacing the modelled mode's text)
REAL_MODEL = {  # unpadded; real_model(pad_s) when padded
    "measured": "sync_diloco and decoupled: real learner processes, each in its own network namespace behind "
                "a veth pair shaped by tbf at the cap each way, reaching a real S3 server (moto) over HTTP "
                "through it; compute unpadded (this machine's CPU, under whatever load it has); held-out "
                "loss of every committed version at its commit time; bytes from the veth counters (kernel) "
                "beside the application's own count. dp: M gloo processes in the same namespaces, "
                "DistributedDataParallel all-reducing fp32 gradients through the same links: its step time "
                "and bytes per step measured",
    "modelled": "dp's loss per step comes from its uncapped curve of the same seed (it does not depend on "
                "the link): its time to target = steps to target x the measured step time, its bytes = "
                "kernel bytes per measured step x steps; torchft_diloco (when run) as in the modelled mode; "
                "no latency is added (no netem here): round trips are the kernel's",
    "cap": "paper-equivalent: DP's fp32 ring all-reduce per step / (39.6 x DP's compute step measured in the "
           "namespaces, every rank computing at once), unless --link-mb-s",
    "tokens": "data-parallel trains tokens_per_method; sync_diloco and decoupled train "
              "diloco_tokens_per_method",
}


def real_model(pad_s: float | None) -> dict[str, str]:
    """REAL_MODEL, or with `pad_s` what padding changes in it."""
    if pad_s is None:
        return REAL_MODEL
    text = (f"compute padded: every inner step of sync_diloco and decoupled and every DP rank's compute step "
            f"last at least {pad_s:g} s (the rest slept), as if each site computed at that speed — this "
            "machine's 2 cores are shared by the learners, the S3 server and the merger, which a deployment "
            "runs apart")
    measured = REAL_MODEL["measured"].replace("compute unpadded (this machine's CPU, under whatever load it "
                                              "has)", text)
    return {**REAL_MODEL, "measured": measured,
            "cap": REAL_MODEL["cap"].replace("DP's compute step measured", "DP's padded compute step")}


def first_at(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, loss in curve if loss <= target), None)


class RealLinks:
    """The links, the server and the bucket for one `bench wan --links real`; `dp` holds the DP
    measurement."""

    def __init__(self, num_learners: int, tag: str | None = None, server: str = "moto") -> None:
        self.net = LinkNet(num_learners, None, tag)
        self.server_kind = server  # _s3_server.SERVERS
        self.stack = contextlib.ExitStack()
        self.endpoint = self.bucket = ""
        self.server = None
        self.dp: dict[str, Any] = {}
        self.cut_s = 0.0
        self.pad_s: float | None = None  # every DiLoCo inner step and DP's compute padded to it (None: real)

    def __enter__(self) -> RealLinks:
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.net)
            self.endpoint, self.server = stack.enter_context(s3_server(self.net.host_addr, self.server_kind))
            self.net.adopt(self.server.pid)
            self.bucket = new_bucket(self.endpoint)
            self.stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def measure(self, cfg, corpus, caps_of, *, quick: bool, cut_s: float, num_caps: int,
                pad_s: float | None = None) -> list[float]:
        """Data-parallel over the links; the rows' caps (from `caps_of(compute step s)`); `pad_s`: DP's
        compute and every DiLoCo inner step padded to it."""
        counts = QUICK_DP if quick else {"steps": DP_STEPS, "warm_steps": DP_WARM_STEPS,
                                         "compute_steps": DP_COMPUTE_STEPS}
        self.cut_s, self.pad_s = cut_s, pad_s
        self.dp = measure_dp(self.net, cfg, corpus, caps_of, cut_s=cut_s, num_caps=num_caps, pad_s=pad_s,
                             **counts)
        return self.dp["caps"]

    def wan_run(self, run: WanRun, row: int, cap_mb_s: float, compute_step_s: float) -> WanRun:
        """`run` over the real links at `cap_mb_s`: with `cut_s`, the first row's learner 0 is cut mid-run."""
        self.net.set_rate(cap_mb_s)
        cut = None
        if self.cut_s > 0 and row == 0:
            cut = (0, run.steps * compute_step_s / 2, self.cut_s)
        padded = {} if self.pad_s is None else {"step_time_s": self.pad_s}
        return dataclasses.replace(run, link=LinkSpec(),
                                   storage_url=f"s3://{self.bucket}/row{row}-{run.name}",
                                   sites=self.net, pad=self.pad_s is not None, cut=cut, **padded)

    def record(self) -> dict[str, Any]:
        """What the JSON's config says about the links."""
        return {"tag": self.net.tag, "host_addr": self.net.host_addr,
                "sites": [s.addr for s in self.net.sites],
                "s3_server": f"{SERVERS[self.server_kind]} on the bridge's host address",
                "s3_server_kind": self.server_kind,
                "s3_server_cpu_s": cpu_s(self.server) if self.server else None,
                "tbf_at_cap": " ".join(tbf_args(self.dp["caps"][0])) if self.dp else None,
                "dp_compute_step_s": self.dp.get("compute_step_s"),
                "dp_compute_step_s_measured": self.dp.get("compute_step_s_measured"),
                "padded_step_s": self.pad_s,
                "dp_compute_step_s_per_rank": self.dp.get("compute_step_s_per_rank")}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def dp_entry(curve: list[tuple[int, float]], measured: dict[str, Any], compute_step_s: float, steps: int,
             target: float) -> dict[str, Any]:
    """Data-parallel's entry: its curve per step on the measured step time, its bytes from the kernel's
    counters."""
    step_s = _mean([t for rank in measured["step_s"] for t in rank])
    per_step = len(measured["step_s"][0])
    sent = [k["sent"] / per_step * steps for k in measured["kernel"]]
    received = [k["received"] / per_step * steps for k in measured["kernel"]]
    at = first_at(curve, target)
    rank0 = measured["step_s"][0]
    return {"time_to_target_s": None if at is None else at * step_s, "steps_to_target": at,
            "final_loss": curve[-1][1], "wall_s": steps * step_s, "step_s": step_s,
            "step_s_spread": [min(rank0), statistics.median(rank0), max(rank0)], "timed_steps": per_step,
            "compute_s_per_step": compute_step_s, "allreduce_s_per_step": step_s - compute_step_s,
            "busy_mean": compute_step_s / step_s, "bytes_sent_per_learner": _mean(sent),
            "bytes_received_per_learner": _mean(received), "kernel_bytes_sent": sent,
            "kernel_bytes_received": received,
            "kernel_bytes_sent_per_learner": _mean(sent),
            "kernel_bytes_received_per_learner": _mean(received),
            "kernel_bytes_per_step": [[k["sent"] / per_step,
                                       k["received"] / per_step] for k in measured["kernel"]],
            "curve": [[round(s * step_s, 3), loss] for s, loss in curve], "modelled": False,
            "measured": f"step time over the links ({per_step} steps x {len(measured['step_s'])} ranks, "
                        "gloo); loss per step from the uncapped curve of the same seed; bytes = kernel bytes "
                        "per step x steps"}


def kernel_fields(result: WanResult) -> dict[str, Any]:
    """A DiLoCo row's kernel-counted bytes per learner beside the application's, and the difference per
    request (HTTP headers, TCP/IP/Ethernet headers and ACKs: what the application does not see)."""
    if result.kernel is None:
        return {"kernel_bytes_sent": None, "kernel_bytes_received": None}
    sent = [k["sent"] for k in result.kernel]
    received = [k["received"] for k in result.kernel]
    app_sent = [r.link["bytes_up"] for r in result.learners]
    app_received = [r.link["bytes_down"] for r in result.learners]
    requests = [r.link["requests"] for r in result.learners]
    return {"kernel_bytes_sent": sent, "kernel_bytes_received": received,
            "kernel_bytes_sent_per_learner": _mean(sent),
            "kernel_bytes_received_per_learner": _mean(received),
            "app_bytes_sent": app_sent, "app_bytes_received": app_received, "requests": requests,
            "kernel_packets": [[k["packets_sent"], k["packets_received"]] for k in result.kernel],
            "overhead_per_request_bytes": {
                "sent": _mean([(k - a) / max(1, n) for k, a, n in zip(sent, app_sent, requests,
                                                                      strict=True)]),
                "received": _mean([(k - a) / max(1, n) for k, a, n in zip(received, app_received, requests,
                                                                          strict=True)])}}


def cut_fields(result: WanResult, h: int, down_s: float) -> dict[str, Any]:
    """What learner 0's cut did to a DiLoCo row: steps each learner computed while it was down, busy, bytes
    shipped."""
    window = result.extra.get("cut_window_s")
    if not window:
        return {"down_s": down_s, "window_s": None}
    lo, hi = window

    def steps_in(r) -> int:  # phases that ended inside the window, each ~H steps
        return h * sum(1 for t in r.phase_ends_s if lo <= t <= hi)

    learners = result.learners
    return {"down_s": down_s, "window_s": [lo, hi], "learner": learners[0].name,
            "steps_during_cut": [steps_in(r) for r in learners],
            "busy": [r.busy for r in learners],
            "delta_bytes_sent": [r.sent.get("delta", 0) for r in learners],
            "phases_after_cut": [sum(1 for t in r.phase_ends_s if t > hi) for r in learners]}


def dp_cut_fields(dp: dict[str, Any], clean_step_s: float) -> dict[str, Any] | None:
    """What the cut did to data-parallel: the steps timed across it and the time lost (all ranks wait)."""
    cut = dp.get("cut")
    if not cut:
        return None
    steps = cut["steps"]  # per rank: [end time, duration] of CUT_STEPS steps
    took = [max(rank[i][1] for rank in steps) for i in range(len(steps[0]))]
    lo, hi = cut["window"] or (0.0, 0.0)
    return {"down_s": cut["down_s"], "link_mb_s": cut["link_mb_s"], "step_s": took,
            "stall_s": sum(took) - len(took) * clean_step_s, "clean_step_s": clean_step_s,
            "steps_done_while_down": sum(1 for end, _ in steps[0] if lo < end < hi)}

"""Where the CPU and the time of `bench wan --links real`'s decoupled row go (issue #43; docs/bench/wan.md,
"Where the decoupled learners' time went").

Runs that row alone — 4 learners in network namespaces behind tbf-capped veths, 8 fragments in two cohorts,
every inner step padded to PAD_S, the cap from data-parallel's compute step measured over the links (a 3-step
measurement) — for STEPS steps per learner, and prints:
- the row's figures: wall, final held-out loss, run versions, each learner's real step (ms), the share of its
  steps over the pad, its store requests and installs;
- the merger's passes (ShardMerger.poll_once): how many, the median of those that merged nothing and of those
  that merged;
- the merger's store calls by kind (count, mean ms), the slowest first;
- CPU seconds over the row per process and per thread (psutil, sampled every 5 s): the learners, the merger
  (this process), the S3 server.

Needs root (CAP_NET_ADMIN). Usage, from the repository root after `make setup`:
    .venv/bin/python scripts/profile_wan_row.py 400 0.14 [--server rclone|moto] [-o key=value ...]
`-o` overrides the run's config (learner and merger options) after the bench's own engine overrides.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import threading
import time

import psutil
import torch
import yaml

from diloco.bench import _wan_runs
from diloco.bench._quality_runs import HeldOut
from diloco.bench._wan_real import REAL_PREFETCH, RealLinks
from diloco.bench.throttle import LinkSpec
from diloco.bench.wan import default_cap_mb_s
from diloco.configs import load_config
from diloco.merger.loop import ShardMerger
from diloco.specs.gpt import build_model, load_corpus
from diloco.storage.store import ObjectStore

STORE_CALLS = ("get", "get_size", "put", "put_if_absent", "list", "folders", "sizes")


class CpuSampler:
    """Every thread's CPU below this process (psutil), first and last seen, every `every_s`."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.first: dict[tuple[int, int], float] = {}
        self.last: dict[tuple[int, int], float] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True, name="cpu-sampler")
        self._thread.start()

    def _run(self, every_s: float) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            for proc in [me, *me.children(recursive=True)]:
                try:
                    self.names.setdefault(proc.pid, " ".join(proc.cmdline())[:70])
                    for thread in proc.threads():
                        key = (proc.pid, thread.id)
                        self.first.setdefault(key, thread.user_time + thread.system_time)
                        self.last[key] = thread.user_time + thread.system_time
                except psutil.Error:
                    continue  # gone since
            self._stop.wait(every_s)

    def stop(self) -> list[tuple[float, int, int]]:
        """(CPU s over the sampling, pid, tid), the most first."""
        self._stop.set()
        self._thread.join()
        return sorted(((self.last[k] - self.first[k], *k) for k in self.last), reverse=True)


def count_merger_calls(owner: int) -> tuple[collections.Counter, collections.Counter]:
    """ObjectStore's calls made by process `owner` (the merger's; forked learners do not count), by method and
    key kind (digits as N): (counts, seconds)."""
    counts, seconds = collections.Counter(), collections.Counter()

    def wrap(name: str) -> None:
        inner = getattr(ObjectStore, name)

        def counted(self, key, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(self, key, *args, **kwargs)
            finally:
                if os.getpid() == owner:
                    kind = (name, re.sub(r"\d+", "N", "/".join(key.split("/")[-3:])))
                    counts[kind] += 1
                    seconds[kind] += time.perf_counter() - t0

        setattr(ObjectStore, name, counted)

    for name in STORE_CALLS:
        wrap(name)
    return counts, seconds


def time_passes() -> list[tuple[float, int]]:
    """(seconds, merges) of every ShardMerger.poll_once from now on."""
    passes: list[tuple[float, int]] = []
    inner = ShardMerger.poll_once

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        merged = inner(self, *args, **kwargs)
        passes.append((time.perf_counter() - t0, len(merged)))
        return merged

    ShardMerger.poll_once = timed
    return passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", type=int, help="inner steps per learner (a multiple of H = 40)")
    parser.add_argument("pad_s", type=float, help="every inner step (and DP's compute) padded to this")
    parser.add_argument("--server", default="rclone", choices=("rclone", "moto"))
    parser.add_argument("-o", "--override", action="append", default=[], help="key=value (YAML value)")
    args = parser.parse_args()
    overrides = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.override)}
    torch.set_num_threads(1)
    cfg = load_config("bench").with_overrides({"inner.total_steps": args.steps})
    m = cfg.run.num_learners
    num_params = sum(p.numel() for p in build_model(cfg.model).parameters())
    held = HeldOut(cfg, load_corpus(cfg.data))
    engine = _wan_runs.engine_overrides
    _wan_runs.engine_overrides = lambda c, r: {**engine(c, r), **overrides}
    with RealLinks(m, server=args.server) as real:
        caps = real.measure(cfg, load_corpus(cfg.data), lambda c: [default_cap_mb_s(num_params, m, c)],
                            quick=True, cut_s=0.0, num_caps=1, pad_s=args.pad_s)
        print(f"cap {caps[0]:.4f} MB/s, pad {args.pad_s:g} s, server {args.server}, overrides {overrides}",
              flush=True)
        run = _wan_runs.WanRun("decoupled", "carry", LinkSpec.symmetric(caps[0], 0.0), args.pad_s, args.steps,
                               cohorts=True, fragments=8)
        run = real.wan_run(run, 0, caps[0], real.dp["compute_step_s"])
        counts, seconds = count_merger_calls(os.getpid())
        passes = time_passes()
        sampler = CpuSampler()
        result = _wan_runs.run_wan(cfg.with_overrides(REAL_PREFETCH), run, held, cfg.data.seed)
        cpu = sampler.stop()
    learners = result.learners
    print(json.dumps({
        "wall_s": round(result.wall_s, 1), "final_loss": round(result.final_loss, 4),
        "versions": result.versions,
        "real_step_ms": [round(1e3 * r.real_compute_s / r.steps, 1) for r in learners],
        "steps_over_pad": [round(r.steps_over_pad / r.steps, 3) for r in learners],
        "busy": [round(r.busy, 3) for r in learners], "requests": [r.link.get("requests") for r in learners],
        "installs": [r.installs for r in learners]}))
    idle = [t for t, n in passes if n == 0] or [0.0]
    merging = [t for t, n in passes if n] or [0.0]
    print(f"merger passes {len(passes)}: {len(idle)} merged nothing (median "
          f"{1e3 * statistics.median(idle):.0f} ms), {len(merging)} merged (median "
          f"{1e3 * statistics.median(merging):.0f} ms), "
          f"{sum(n for _, n in passes)} merges")
    for kind, n in sorted(counts.items(), key=lambda kv: -seconds[kv[0]])[:12]:
        print(f"  merger store {kind[0]:>13} {kind[1]:<36} {n:6d} calls, "
              f"{1e3 * seconds[kind] / n:6.1f} ms each")
    per_process = collections.Counter()
    for seconds_used, pid, _ in cpu:
        per_process[pid] += seconds_used
    for pid, used in per_process.most_common(10):
        print(f"  CPU {used:7.1f} s  process {pid}  {sampler.names.get(pid, '?')}")
    for used, pid, tid in cpu[:14]:
        print(f"  CPU {used:7.1f} s  thread {pid}/{tid}")


if __name__ == "__main__":
    sys.exit(main())

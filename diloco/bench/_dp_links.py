"""Data-parallel for real behind the links of `bench wan --links real`: M torch.distributed processes (gloo),
rank i in site i's namespace, DistributedDataParallel all-reducing fp32 gradients through the capped links.

Contract: `measure_dp(...)` times (1) `compute_steps` steps of each rank alone (no collective: the compute
part of a step, which sets the paper-equivalent cap), then per cap (2) `warm_steps` untimed steps and `steps`
timed ones of real DP, the kernel's byte counters of every site read before and after the timed steps, and
with `cut_s` (3) `CUT_STEPS` steps during which site 0's link goes down for cut_s seconds. The ranks draw the
global batch (M x B) of data-parallel's curve and each trains on its slice: the same algorithm as
`wan.dp_curve`, whose loss per step does not depend on the link. Nothing is assumed: a rank that fails ends
the measurement with its error.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from diloco.configs import Config

DP_PORT = 29500  # rank 0's rendezvous, inside its own namespace (every port is free there)
CUT_STEPS = 3  # steps timed across a cut: the stalled one and two after it
BARRIER_TIMEOUT_S = 900.0


def _rank_main(net, rank: int, cfg: Config, corpus, compute_steps: int, plan: list[tuple[int, int]],
               cut_s: float, barrier, out, pad_s: float = 0.0) -> None:
    """One DP rank (forked): enter site `rank`, join the gloo world over the links, then the phases above."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from diloco.training.data import ShardSampler
    from diloco.training.inner import InnerTrainer
    from diloco.training.model import build_model
    from diloco.training.spec import slice_batch

    try:
        net.enter(rank)
        os.environ["GLOO_SOCKET_IFNAME"] = net.sites[rank].inner_if  # gloo's pairs go over the capped link
        torch.set_num_threads(1)
        m = len(net.sites)
        dist.init_process_group("gloo", init_method=f"tcp://{net.sites[0].addr}:{DP_PORT}", rank=rank,
                                world_size=m, timeout=datetime.timedelta(seconds=max(300.0, 4 * cut_s)))
        model = build_model(cfg.model, seed=cfg.data.seed)
        sampler = ShardSampler(corpus.train, 0, 1, m * cfg.data.batch_size, cfg.model.ctx_len, cfg.data.seed)

        pad = 0.0  # slept before each step: pad_s less this rank's compute step

        def timed(step: Callable[..., float]) -> tuple[float, float]:
            batch = slice_batch(sampler.next_batch(), rank, m)
            t0 = time.perf_counter()
            if pad > 0:
                time.sleep(pad)
            step(*batch)
            return time.time(), time.perf_counter() - t0

        alone = InnerTrainer(model, cfg.inner)
        compute = [timed(alone.train_step)[1] for _ in range(compute_steps)]
        out.put(("compute", rank, compute))
        pad = max(0.0, pad_s - statistics.median(compute))
        ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters: every rank starts equal
        trainer = InnerTrainer(model, cfg.inner, forward_model=ddp)
        for row, (warm, steps) in enumerate(plan):
            barrier.wait(BARRIER_TIMEOUT_S)  # the parent has set this row's cap
            for _ in range(warm):
                timed(trainer.train_step)
            barrier.wait(BARRIER_TIMEOUT_S)  # the parent reads the counters
            barrier.wait(BARRIER_TIMEOUT_S)
            out.put(("steps", rank, row, [timed(trainer.train_step)[1] for _ in range(steps)]))
            barrier.wait(BARRIER_TIMEOUT_S)  # the parent reads the counters again
        if cut_s > 0:
            barrier.wait(BARRIER_TIMEOUT_S)  # the parent cuts site 0's link now
            out.put(("cut", rank, [timed(trainer.train_step) for _ in range(CUT_STEPS)]))
        # no destroy_process_group(): gloo's can deadlock on the GIL at teardown;
        out.put(("done", rank, None))
        # the process ends here (os._exit) and its sockets with it
    except BaseException as err:  # reported: the parent must not wait on a barrier for a dead rank
        out.put(("error", rank, f"{type(err).__name__}: {err}"))
        barrier.abort()
        raise


class _Inbox:
    """The ranks' reports, read as they come; an error report (or a dead rank) raises."""

    def __init__(self, out, procs) -> None:
        self.out, self.procs, self.got = out, procs, []

    def take(self, kind: str, count: int, timeout_s: float = BARRIER_TIMEOUT_S) -> list[tuple]:
        deadline = time.time() + timeout_s
        found = [msg for msg in self.got if msg[0] == kind]
        self.got = [msg for msg in self.got if msg[0] != kind]
        while len(found) < count:
            if time.time() > deadline:
                raise RuntimeError(f"data-parallel: {count - len(found)} '{kind}' reports missing after "
                                   f"{timeout_s:.0f}s")
            try:
                msg = self.out.get(timeout=1.0)
            except Exception:  # queue.Empty
                if any(p.exitcode not in (None, 0) for p in self.procs):
                    raise RuntimeError("data-parallel: a rank died (exit codes "
                                       f"{[p.exitcode for p in self.procs]})") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"data-parallel rank {msg[1]} failed: {msg[2]}")
            (found if msg[0] == kind else self.got).append(msg)
        return sorted(found, key=lambda msg: msg[1])


def _wait(barrier) -> None:
    import threading

    try:
        barrier.wait(BARRIER_TIMEOUT_S)
    except threading.BrokenBarrierError:
        raise RuntimeError("data-parallel: a rank failed (the barrier broke)") from None


def measure_dp(net, cfg: Config, corpus, caps_mb_s: Callable[[float], list[float]], *, compute_steps: int,
               warm_steps: int, steps: int, cut_s: float, num_caps: int,
               pad_s: float | None = None) -> dict[str, Any]:
    """Real DP over `net`'s sites. `caps_mb_s(compute_step_s)` gives the rows' caps from the ranks' compute
    step (the median over ranks of each rank's measured median; with `pad_s`, the larger of it and pad_s, the
    compute each step is padded to); returns {"compute_step_s", "compute_step_s_measured", "pad_s", "caps",
    "rows": [per cap: {"link_mb_s", "step_s" (all ranks' timed steps), "kernel" (per site, bytes over the
    timed steps)}], "cut"}."""
    ctx = mp.get_context("fork")
    m, plan = len(net.sites), [(warm_steps, steps)] * num_caps
    barrier, out = ctx.Barrier(m + 1), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(net, r, cfg, corpus, compute_steps, plan, cut_s, barrier,
                                                  out, pad_s or 0.0),
                         name=f"dp-{r}", daemon=True) for r in range(m)]
    for p in procs:
        p.start()
    inbox, finished = _Inbox(out, procs), False
    try:
        compute = [statistics.median(msg[2]) for msg in inbox.take("compute", m)]
        measured = statistics.median(compute)
        compute_step_s = max(measured, pad_s or 0.0)
        caps = caps_mb_s(compute_step_s)
        rows = []
        for row, cap in enumerate(caps):
            net.set_rate(cap)
            _wait(barrier)
            _wait(barrier)
            before = net.counters()
            _wait(barrier)
            _wait(barrier)
            after = net.counters()
            times = [msg[3] for msg in inbox.take("steps", m) if msg[2] == row]
            rows.append({"link_mb_s": cap, "step_s": times,
                         "kernel": [{k: b[k] - a[k] for k in b} for a, b in zip(before, after, strict=True)]})
        cut = None
        if cut_s > 0:
            net.set_rate(caps[0])
            _wait(barrier)
            thread = net.cut(0, cut_s)
            steps_cut = [msg[2] for msg in inbox.take("cut", m, BARRIER_TIMEOUT_S + cut_s)]
            thread.join(cut_s + 30)
            cut = {"link_mb_s": caps[0], "site": 0, "down_s": cut_s, "window": thread.times,
                   "steps": [[list(s) for s in rank_steps] for rank_steps in steps_cut]}
        inbox.take("done", m, timeout_s=120.0)
        finished = True
    finally:
        for p in procs:  # after an error or a signal the ranks may sit in a collective: end them at once
            p.join(30 if finished else 0)
            if p.is_alive():
                p.kill()
                p.join(5)
    return {"compute_step_s": compute_step_s, "compute_step_s_measured": measured, "pad_s": pad_s,
            "compute_step_s_per_rank": compute, "caps": caps, "rows": rows, "cut": cut}

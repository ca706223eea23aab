"""The peer row of `bench quality` and `bench wan`: torchft's DiLoCo (PyPI torchft 0.2.0, `pip install
'diloco[peer]'`) on our model, data and tokens — its Lighthouse, one Manager + gloo replica group per learner,
its own outer Nesterov, optionally its streaming fragments.

Contract: run_torchft(cfg, steps, seed) starts a Lighthouse here and M replica processes (`python -m
diloco.bench.peer_torchft worker SPEC`), each training exactly `steps` inner steps of batch B on the shard a
learner of that name would read; returns replica 0's held-out loss after every sync and at the end, the
all-reduce payload each replica handed to gloo (counted), and the wall time; PeerUnavailable (one line, why)
when torchft is not installed or a replica fails. Its wire bytes and its time behind a cap are modelled
(ring all-reduce of the measured payload); its transport is not throttled.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any

from diloco.bench.bandwidth import allreduce_bytes_per_step
from diloco.bench.throttle import LinkSpec
from diloco.configs import Config

TORCHFT_VERSION = "0.2.0"
# replicas' imports take 3-14 s each on a loaded 2-core box; the first quorum waits for all
QUORUM_TIMEOUT_S = 300
RESULT = "RESULT "


class PeerUnavailable(RuntimeError):
    """torchft cannot run here; the message says why (not installed, or a replica failed)."""


def available() -> str | None:
    """None when torchft imports here, else why not."""
    if importlib.util.find_spec("torchft") is None:
        return ("torchft is not installed (pip install 'diloco[peer]', i.e. torchft==0.2.0; `make setup` "
                "installs it when it keeps torch pinned)")
    return None


def run_torchft(cfg: Config, steps: int, seed: int, *, fragments: int = 1, sync_delay: int = 0,
                alpha: float = 0.0) -> dict[str, Any]:
    """torchft DiLoCo (fragments=1) or Streaming DiLoCo (fragments=2) at equal tokens; see the module doc."""
    why = available()
    if why:
        raise PeerUnavailable(why)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO
    from torchft.coordination import LighthouseServer

    m = cfg.run.num_learners
    cfg = cfg.with_overrides({"data.seed": seed, "inner.total_steps": steps})
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=m, join_timeout_ms=QUORUM_TIMEOUT_S * 1000,
                                  quorum_tick_ms=100, heartbeat_timeout_ms=5000)
    t0 = time.time()
    try:
        spec = {"config": cfg.model_dump(mode="json"), "steps": steps, "lighthouse": lighthouse.address(),
                "fragments": fragments, "sync_delay": sync_delay, "alpha": alpha}
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs = [subprocess.Popen([sys.executable, "-m", "diloco.bench.peer_torchft", "worker",
                                   json.dumps({**spec, "replica": r})], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(m)]
        outs = [p.communicate(timeout=QUORUM_TIMEOUT_S + 60 * max(1, steps // 100)) for p in procs]
    finally:
        lighthouse.shutdown()
    results = []
    for r, (p, (stdout, stderr)) in enumerate(zip(procs, outs, strict=True)):
        line = next((ln for ln in stdout.splitlines() if ln.startswith(RESULT)), None)
        if p.returncode != 0 or line is None:
            tail = (stderr or stdout).strip().splitlines()[-3:]
            raise PeerUnavailable(f"torchft replica {r} failed (exit {p.returncode}): {' | '.join(tail)}")
        results.append(json.loads(line[len(RESULT):]))
    head = results[0]
    payload = sum(r["allreduce_payload_bytes"] for r in results) / m
    return {
        "final_loss": head["final_loss"], "curve": head["curve"], "wall_s": time.time() - t0, "steps": steps,
        "syncs": head["syncs"], "fragments": fragments, "sync_delay": sync_delay, "alpha": alpha,
        "allreduce_payload_bytes_per_learner": payload,
        "bytes_per_learner_ring_model": allreduce_bytes_per_step(1, m, payload),
        "allreduce_calls": head["allreduce_calls"], "quorum_s_mean": head["quorum_s_mean"],
        "real_step_s_mean": sum(r["compute_s"] for r in results) / (m * steps),
        "weights_equal": len({r["weight_sum"] for r in results}) == 1, "torchft": head["torchft_version"],
    }


def wan_entry(run: dict[str, Any], step_s: float, link: LinkSpec, num_learners: int,
              target: float) -> dict[str, Any]:
    """torchft's measured loss per sync on a modelled clock: `step_s` per inner step, and per sync a ring
    all-reduce of its measured payload at the cap plus (M-1) hops and one quorum round trip."""
    from diloco.bench.wan import allreduce_s, first_below

    per_sync = run["allreduce_payload_bytes_per_learner"] / max(1, run["syncs"])
    sync_s = allreduce_s(per_sync, link, num_learners) + link.rtt_s
    every = max(1, run["steps"] // max(1, run["syncs"]))
    timed = [(s * step_s + (s // every) * sync_s, loss) for s, loss in run["curve"]]
    total = run["steps"] * step_s + run["syncs"] * sync_s
    traffic = run["bytes_per_learner_ring_model"]
    return {"time_to_target_s": first_below(timed, target), "final_loss": run["final_loss"], "wall_s": total,
            "busy_mean": run["steps"] * step_s / total, "sync_s": sync_s, "bytes_sent_per_learner": traffic,
            "bytes_received_per_learner": traffic, "curve": [[round(t, 3), loss] for t, loss in timed],
            "modelled": True}


def _worker(spec: dict[str, Any]) -> None:
    """One replica group (world size 1): our model, AdamW, data shard; torchft's Manager, gloo and DiLoCo."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torchft
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from diloco.bench._quality_runs import HeldOut
    from diloco.specs.gpt import load_corpus
    from diloco.training.data import ShardSampler, shard_of
    from diloco.training.inner import InnerTrainer, evaluate

    torch.set_num_threads(1)
    cfg, rank, steps = Config.model_validate(spec["config"]), spec["replica"], spec["steps"]
    corpus = load_corpus(cfg.data)
    from diloco.training.model import build_model

    model = build_model(cfg.model, seed=cfg.data.seed)  # the same version 0 as our runs
    trainer = InnerTrainer(model, cfg.inner)
    names = cfg.learner_names()
    shard, num_shards = shard_of(names[rank], names)
    sampler = ShardSampler(corpus.train, shard, num_shards, cfg.data.batch_size, cfg.model.ctx_len,
                           cfg.data.seed)
    held = HeldOut(cfg, corpus) if rank == 0 else None

    class CountingGloo(ProcessGroupGloo):
        calls, payload = 0, 0

        def allreduce(self, tensors, opts):
            self.calls += 1
            self.payload += sum(t.numel() * t.element_size() for t in tensors)
            return super().allreduce(tensors, opts)

    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=QUORUM_TIMEOUT_S)
    pg = CountingGloo(timeout=timeout)
    manager = Manager(pg=pg, load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
                      state_dict=lambda: {"model": model.state_dict()}, min_replica_size=cfg.run.num_learners,
                      use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
                      connect_timeout=timeout,
                      rank=0, world_size=1, store_addr="localhost", store_port=store.port,
                      lighthouse_addr=spec["lighthouse"], replica_id=f"replica_{rank}", hostname="localhost",
                      init_sync=False)
    quorum_s = []
    original = manager.start_quorum

    def timed_quorum(*a, **kw):
        t = time.perf_counter()
        original(*a, **kw)
        quorum_s.append(time.perf_counter() - t)

    manager.start_quorum = timed_quorum
    manager.start_quorum()  # every replica present before the first step (DiLoCo's own first quorum is at H)
    fragments = _fragments(model, spec["fragments"])
    outer = [torch.optim.SGD(f.parameters(), lr=cfg.outer.lr, momentum=cfg.outer.momentum,
                             nesterov=cfg.outer.nesterov) for f in fragments]
    h, curve, compute_s = cfg.inner.steps_per_phase, [], 0.0
    if held is not None:
        curve.append((0, evaluate(model, held.batches)))
    with DiLoCo(manager, fragments, trainer.opt, outer if len(outer) > 1 else outer[0], sync_every=h,
                fragment_sync_delay=spec["sync_delay"], fragment_update_alpha=spec["alpha"]):
        for s in range(1, steps + 1):
            t = time.perf_counter()
            trainer.train_step(*sampler.next_batch())  # the inner step; DiLoCo's hook syncs on its schedule
            compute_s += time.perf_counter() - t
            if held is not None and s % h == 0:
                curve.append((s, evaluate(model, held.batches)))
    final = evaluate(model, held.batches) if held is not None else float("nan")
    print(RESULT + json.dumps({
        "final_loss": final, "curve": curve, "syncs": len(quorum_s) - 1, "allreduce_calls": pg.calls,
        "allreduce_payload_bytes": pg.payload, "quorum_s_mean": sum(quorum_s) / len(quorum_s),
        "compute_s": compute_s, "weight_sum": round(sum(float(p.double().sum()) for p in model.parameters()),
                                                    6),
        "torchft_version": getattr(torchft, "__version__", TORCHFT_VERSION)}), flush=True)
    manager.shutdown(wait=False)


def _fragments(model, count: int) -> list:
    """1: the whole model. 2: [embeddings + the first half of the blocks], [the rest + final norm] (the head
    is tied to the token embedding, so it travels with fragment 0)."""
    from torch import nn

    if count == 1:
        return [model]
    if count != 2:
        raise ValueError(f"fragments must be 1 or 2, got {count}")
    half = max(1, len(model.blocks) // 2)
    return [nn.ModuleList([model.wte, model.wpe, *model.blocks[:half]]),
            nn.ModuleList([*model.blocks[half:], model.ln_f])]


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "worker":
        sys.exit("usage: python -m diloco.bench.peer_torchft worker SPEC_JSON")
    _worker(json.loads(sys.argv[2]))

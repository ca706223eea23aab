"""The processes of one `diloco bench scale` row: the merger's rounds, a learner's rejoin, a merger's cold
restart — each in a fresh spawned process on the file:// run the parent created (diloco/bench/scale.py).

Contract: every round's deltas are the same synthetic int4 deltas (one per fragment and learner, encoded
once by the parent as templates) with the round's header (seq r, base version r), so the rows cost one
encode, not one per round; a learner's deltas older than K rounds are deleted (the merges a restart replays
are the last K - 1). The merger is the production path: one ShardMerger holding every owned chain's state,
a checkpoint every K versions on its writer thread, which lands before the next round is timed (its time is
`state_io_s`, per round).
"""

from __future__ import annotations

import gc
import resource
import time
from typing import Any

import torch

from diloco.configs import checkpoint_every
from diloco.storage.codec.header import rehead

TEMPLATES = "templates"  # the parent's deltas, outside the run: <fragment>/<learner>


def template_key(fragment: int, learner: str) -> str:
    return f"{TEMPLATES}/{fragment:04d}/{learner}"


def _chains(ctx) -> list:
    from diloco.run.fragments import chain_contexts

    return chain_contexts(ctx)


def publish_round(raw, ctx, r: int, keep_rounds: int) -> None:
    """Round r's deltas (seq r on base version r) of every learner on every chain; those of round r -
    keep_rounds deleted."""
    for index, chain in enumerate(_chains(ctx)):
        for name in ctx.learners:
            data = rehead(raw.get(template_key(index, name)), seq=r, base_version=r)
            raw.put_if_absent(chain.keys.delta(name, r), data)
            if r - keep_rounds >= 0:
                raw.delete(chain.keys.delta(name, r - keep_rounds))


def _timed_writes(durations: list[float]) -> None:
    """Time every checkpoint this process writes (state_io_s)."""
    import diloco.merger.checkpointer as checkpointer

    real = checkpointer.write_checkpoint

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            durations.append(time.perf_counter() - t0)

    checkpointer.write_checkpoint = timed


# timed passes of a figure measured once a row (read + decode, rejoin, full-params read): the row reports
# their median (one pass moved by +-25% between runs: 3.05 / 2.21 s read + decode at P = 1, no change to it)
PASSES = 3


def rounds_child(storage: str, run_id: str, first: int, last: int, decode: bool, queue: Any) -> None:
    """Rounds first..last (round r makes version r + 1) by one merger process: per round the merge time and
    its memory (the growth of peak RSS over it, plus the blocks its merges keep between rounds, held before
    it), the page faults its process took over it (every thread's: the merge and the checkpoint writer beside
    it); the bytes it wrote; the checkpoint writes' time; read + decode of the
    last round, PASSES times (`decode`; else read_decode_s is None)."""
    from diloco.bench.scale import peak_rss_bytes, reset_peak_rss
    from diloco.merger.loop import ShardMerger
    from diloco.run.context import open_run
    from diloco.run.objects import decode_tensors
    from diloco.storage import open_store
    from diloco.storage.traffic import CountingStore

    torch.set_num_threads(1)
    raw = open_store(storage)
    counting = CountingStore(raw)
    writes: list[float] = []
    _timed_writes(writes)
    t0 = time.perf_counter()  # a cold merger: from opening the run until every chain it owns can merge
    ctx = open_run(counting, run_id)
    shard = ShardMerger(ctx, 0)
    for index in shard.fragments:
        shard.chain(index)
    load_s = time.perf_counter() - t0
    replayed = sum(shard.chains[i].state.last_load.replayed for i in shard.fragments)
    counting.reset()
    keep = checkpoint_every(ctx.cfg)
    merge_s, peaks, highs, kept, faults = [], [], [], [], []
    arenas = next(iter(shard.chains.values())).arenas  # the blocks its merges keep (shared by its chains)
    for r in range(first, last + 1):
        publish_round(raw, ctx, r, keep)
        for merger in shard.chains.values():
            merger.checkpoints.flush()  # the last round's checkpoint lands before this one is timed
        gc.collect()
        # a merge's memory: what its blocks kept from the merges before, and its growth over the round
        kept.append(arenas.sums.held_bytes + arenas.buffers.held_bytes)
        before = reset_peak_rss()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        merged = shard.poll_once()
        merge_s.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0)
        peaks.append(peak_rss_bytes() - before + kept[-1])
        highs.append(peak_rss_bytes())
        if len(merged) != len(shard.fragments) or any(len(m.merged()) != len(ctx.learners) for m in merged):
            raise RuntimeError(f"round {r}: {len(merged)} merges for {len(shard.fragments)} chains")
    shard.close()

    def read_decode() -> float:
        t0 = time.perf_counter()
        for chain in _chains(ctx):
            for name in ctx.learners:
                decode_tensors(raw.get(chain.keys.delta(name, last)))
        return time.perf_counter() - t0

    read_decode_s = [read_decode() for _ in range(PASSES)] if decode else None
    queue.put({"merge_s": merge_s, "peak_rss_bytes": peaks, "rss_high_bytes": highs, "kept_bytes": kept,
               "faults": faults, "read_decode_s": read_decode_s,
               "sent_bytes": sum(counting.sent.values()), "sent": dict(counting.sent), "checkpoint_s": writes,
               "load_s": load_s, "replayed": replayed})


def rejoin_child(storage: str, run_id: str, queue: Any) -> None:
    """A learner from nothing at the newest version (its checkpoint and the updates after it, every chain:
    what learner/resume.py reads), timed with the bytes it read; then today's full-params rejoin of the
    same version (one fp32 params object per chain, written here first) for reference. Each timed PASSES
    times, alternately."""
    from diloco.learner.resume import read_newest
    from diloco.run.context import open_run
    from diloco.run.objects import read_committed, write_state
    from diloco.storage import open_store
    from diloco.storage.traffic import CountingStore

    torch.set_num_threads(1)
    counting = CountingStore(open_store(storage))

    def rejoin() -> float:
        ctx = open_run(counting, run_id)  # a learner from nothing each time
        gc.collect()
        t0 = time.perf_counter()
        newest = read_newest(ctx)  # what resume() reads: every chain's newest manifest and params
        took = time.perf_counter() - t0
        del newest
        return took

    ctx = open_run(counting, run_id)
    counting.reset()
    newest = read_newest(ctx)
    received = sum(counting.received.values())
    held = [params for _, params in newest]
    versions = [(manifest.version, manifest.state_version) for manifest, _ in newest]
    del newest
    objects = []
    for index, (chain, params) in enumerate(zip(_chains(ctx), held, strict=True)):
        key = f"{chain.keys.global_prefix()}fullparams-{index}"
        _, checksum = write_state(counting.inner, key, params, kind="params", fingerprint=ctx.fingerprint)
        objects.append((key, checksum))
    del held, params

    def full() -> float:
        gc.collect()
        t0 = time.perf_counter()
        for key, checksum in objects:
            read_committed(counting.inner, key, checksum=checksum, fingerprint=ctx.fingerprint)
        return time.perf_counter() - t0

    rejoin_s, full_s = [], []
    for _ in range(PASSES):  # alternately: a slower minute of the machine weighs on both
        rejoin_s.append(rejoin())
        full_s.append(full())
    for key, _ in objects:
        counting.inner.delete(key)
    queue.put({"rejoin_s": rejoin_s, "rejoin_bytes": received, "rejoin_full_params_s": full_s,
               "versions": versions})

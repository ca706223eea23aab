"""Hostile input: pickled, corrupted, wrong-model, NaN, lying and oversized deltas are rejected
with a reason, nothing is executed, and the merger keeps merging the good ones.
Run: .venv/bin/pytest tests/integration/test_hostile_deltas.py -q
"""

from __future__ import annotations

import gc
import os
import pickle
import time

import numpy as np
import torch

from diloco.api.operate import admit_learner
from diloco.configs import load_config
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.run.create import fingerprint_of as model_identity
from diloco.run.objects import encode_tensors
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store
from diloco.training.model import build_model, get_flat_params


class Exploit:
    """Unpickling this runs a shell command: it must never be unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _encode_delta(ctx, params, learner, seq, *, fingerprint=None, **meta):
    base = {"learner": learner, "seq": seq, "base_version": 0, "tokens": 1000, "steps": 10} | meta
    return encode_tensors(params, codec_name="fp32", kind="delta", fingerprint=fingerprint or ctx.fingerprint,
                            meta=base)


def test_hostile_deltas_are_rejected_and_merging_goes_on(tmp_path):
    cfg = load_config("tiny").with_overrides({"run.num_learners": 1, "merger.quorum": 1,
                                              "merger.grace_cap_s": 0.0, "merger.max_delta_bytes": 2_000_000})
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "hostile", cfg)
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, load_corpus(cfg.data)))
    learner.join()
    learner.run_phase()
    learner.publish()
    learner.publisher.drain()
    good = ctx.store.get(ctx.keys.delta("local-0", 0))
    zeros = {k: torch.zeros_like(v) for k, v in get_flat_params(build_model(cfg.model)).items()}
    marker = tmp_path / "pwned"
    other_cfg = cfg.with_overrides({"model.d_model": 16, "model.n_head": 2})
    other = get_flat_params(build_model(other_cfg.model))
    corrupted = bytearray(good)
    corrupted[len(corrupted) // 2] ^= 0x5A
    nan = {k: v.clone() for k, v in zeros.items()}
    next(iter(nan.values())).view(-1)[0] = float("nan")
    hostile = {
        "evil-pickle": pickle.dumps(Exploit(str(marker))),
        "evil-corrupt": bytes(corrupted),
        "evil-truncated": good[: len(good) // 3],
        "evil-shape": _encode_delta(ctx, other, "evil-shape", 0, fingerprint=model_identity(other_cfg)),
        "evil-nan": _encode_delta(ctx, nan, "evil-nan", 0),
        "evil-liar": _encode_delta(ctx, zeros, "local-0", 7),  # header names another learner
        "evil-future": _encode_delta(ctx, zeros, "evil-future", 0, base_version=99),
        "evil-oversized": good + b"\0" * 2_100_000,
    }
    for name, data in hostile.items():
        # admitted writers: what the codec and validation refuse, not admission
        admit_learner(ctx, None, name)
        ctx.store.put(ctx.keys.delta(name, 0), data)

    merger = Merger(ctx)
    merger.load()
    manifest = _freed_without_collection(merger.merge_once)
    assert manifest is not None
    decided = {d.learner: d for d in manifest.decisions}
    assert decided["local-0"].status == "merged"
    for name in hostile:
        assert decided[name].status == "rejected", name
        assert decided[name].reason, name
    assert "checksum" in decided["evil-corrupt"].reason or "corrupt" in decided["evil-corrupt"].reason
    assert "fingerprint" in decided["evil-shape"].reason
    assert "non-finite" in decided["evil-nan"].reason
    assert "oversized" in decided["evil-oversized"].reason
    assert not marker.exists(), "a pickle from the bucket was executed"

    learner.run_phase()
    learner.publish()
    learner.publisher.drain()
    second = merger.merge_once()
    assert second is not None and [d.learner for d in second.merged()] == ["local-0"]
    assert all(second.cursors[name] == 0 for name in hostile)  # decided once, never again
    learner.close()


def _freed_without_collection(merge):
    """merge(), checking that it leaves no tensor, array or delta bytes to the cyclic collector: the merger
    frees every merge's temporaries by reference counting (it runs no gc.collect())."""
    gc.collect()
    gc.disable()
    try:
        out = merge()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
    finally:
        gc.set_debug(0)
        gc.enable()
    held = [o for o in gc.garbage if isinstance(o, torch.Tensor | np.ndarray)
            or (isinstance(o, bytes | bytearray | memoryview) and len(o) > 4096)]
    gc.garbage.clear()
    assert not held, f"a merge left {len(held)} tensors/buffers in reference cycles: {held[:3]!r}"
    return out


def _bomb(ctx, learner: str, shapes: list[tuple[str, list[int]]]) -> bytes:
    """A well-formed int4 delta whose header claims these tensors in frames of the smallest length the codec
    allows (raw / 256): about 530 kB that would make a reader allocate 132 MB per 2^28 values."""
    import math
    import zlib

    from diloco.storage.codec.header import FRAME_BYTES, MAX_FRAME_RATIO, pack_header, stream_bytes

    entries = []
    for name, shape in shapes:
        raw = stream_bytes("int4", math.prod(shape), 256)
        sizes = [min(FRAME_BYTES, raw - s) for s in range(0, raw, FRAME_BYTES)]
        entries.append({"name": name, "shape": shape,
                        "frames": [max(1, -(-(n - 64) // MAX_FRAME_RATIO)) for n in sizes]})
    payload = bytes(sum(sum(e["frames"]) for e in entries))
    meta = {"learner": learner, "seq": 0, "base_version": 0, "tokens": 1000, "steps": 10}
    header = pack_header({"format_version": 1, "kind": "delta", "codec": "int4", "block_size": 256,
                          "shuffle": False, "fingerprint": ctx.fingerprint, "meta": meta,
                          "compression": "zstd", "tensors": entries, "payload_bytes": len(payload),
                          "payload_crc32": zlib.crc32(payload)})
    return header + payload


def test_a_decompression_bomb_is_refused_from_its_header(tmp_path):
    """A 0.5 MB delta claiming 2^28 values (1 GiB in fp32) is judged on its header against the model's layout:
    refused before the merger allocates its payload (issue #44: it raised the merger's peak memory by 1.3 GB
    before)."""
    import tracemalloc

    cfg = load_config("tiny").with_overrides({"run.num_learners": 1, "merger.quorum": 1,
                                              "merger.grace_cap_s": 0.0, "merger.max_delta_bytes": 8_000_000})
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "bomb", cfg)
    first = ctx.layout[0]["name"]  # the model's own tensors, the first one claimed 2^28 values long
    bomb = _bomb(ctx, "evil-bomb", [(first, [1 << 28])] + [(e["name"], e["shape"]) for e in ctx.layout[1:]])
    assert len(bomb) < 1_000_000
    admit_learner(ctx, None, "evil-bomb")
    ctx.store.put(ctx.keys.delta("evil-bomb", 0), bomb)
    merger = Merger(ctx)
    merger.load()
    tracemalloc.start()
    try:
        manifest = merger.merge_once()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    (decision,) = manifest.decisions
    assert decision.status == "rejected" and decision.check == "invalid"
    assert f"tensor 0 is {first!r} of shape [268435456]" in decision.reason
    assert peak < 64 << 20, peak  # the model's tensors and the object; never the claimed 1 GiB


def test_the_size_bound_is_the_models_own_when_the_run_sets_none(tmp_path):
    """merger.max_delta_bytes unset: the largest delta the layout can make in any codec (not a constant
    capping the model); a real delta is under it, one byte more than it is refused unread."""
    from diloco.trust.validate import delta_size_bound

    cfg = load_config("tiny").with_overrides({"run.num_learners": 1, "merger.quorum": 1,
                                              "merger.grace_cap_s": 0.0, "learner.codec": "fp32"})
    assert cfg.merger.max_delta_bytes is None
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "bound", cfg)
    learner = Learner(ctx, "local-0", make_spec(ctx.cfg, load_corpus(cfg.data)))
    learner.join()
    learner.publish(learner.run_phase())
    learner.publisher.drain()
    learner.close()
    params = {e["name"]: torch.zeros(e["shape"]) for e in ctx.layout}
    bound = delta_size_bound(params, [])
    real = ctx.store.get_size(ctx.keys.delta("local-0", 0))
    assert real < bound < 2 * real + (1 << 20)  # fp32: the model's bytes and a header
    admit_learner(ctx, None, "evil-big")
    ctx.store.put(ctx.keys.delta("evil-big", 0), bytes(bound + 1))
    merger = Merger(ctx)
    merger.load()
    decided = {d.learner: d for d in merger.merge_once().decisions}
    assert decided["local-0"].status == "merged"
    assert decided["evil-big"].check == "size" and "the model's largest delta" in decided["evil-big"].reason


def test_keys_no_learner_can_have_written_cost_one_look_each(tmp_path, monkeypatch):
    """Issue #44, invariant 1, planted into a live run: a 4-byte key at seq 999,999,999,999 under a name never
    admitted is one rejection (no cursor, never listed again); the same key under a member's name is further
    ahead than a learner can be: ignored, never a gap to materialise; a real gap is one `lost` decision for
    its whole range; a delta whose judging raises (even a MemoryError) is rejected and the merge goes on."""
    from trust_helpers import one_round, tiny_run

    from diloco.inspect.audit import audit_run
    from diloco.trust import judge as judge_module

    ctx, learners, merger = tiny_run(tmp_path, **{"merger.gap_timeout_s": 0.01})
    one_round(learners, merger)
    huge = 999_999_999_999
    ctx.store.put(ctx.keys.delta("junk-x", huge), b"junk")
    ctx.store.put(ctx.keys.delta("local-0", huge), b"junk")
    first = one_round(learners, merger)
    strangers = [d for d in first.decisions if d.learner == "junk-x"]
    assert [(d.seq, d.status, d.check) for d in strangers] == [(huge, "rejected", "admission")]
    assert "junk-x" not in first.cursors and first.cursors["local-0"] < 10
    assert not [d for d in first.decisions if d.learner == "local-0" and d.seq == huge]
    second = one_round(learners, merger)
    assert not [d for d in second.decisions if d.learner == "junk-x"] and "junk-x" not in second.cursors
    assert len(second.to_bytes()) < 20_000  # no materialised gap, no stranger carried on

    # a real gap of 3 seqs (a learner whose uploads were lost): one decision for the range, once it waited
    seq = learners[0].state.seq
    learners[0].state.seq = seq + 3  # (within learner.max_unmerged: it is not held back)
    rounds = [one_round(learners, merger)]  # the gap seen first ...
    time.sleep(0.05)
    rounds.append(one_round(learners, merger))  # ... waited out: declared lost
    lost = [d for m in rounds for d in m.decisions if d.status == "lost"]
    assert [(d.learner, d.seq, d.seq_last) for d in lost] == [("local-0", seq, seq + 2)]

    # judging that raises rejects the delta, never the merge
    real = judge_module.Judge.judge

    def exploding(self, learner, seq, *args, **kwargs):
        if learner == "local-1":
            raise MemoryError("a delta too big to judge")
        return real(self, learner, seq, *args, **kwargs)

    monkeypatch.setattr(judge_module.Judge, "judge", exploding)
    fourth = one_round(learners, merger)
    (bad,) = [d for d in fourth.decisions if d.learner == "local-1"]
    assert bad.status == "rejected" and "MemoryError: a delta too big to judge" in bad.reason
    monkeypatch.setattr(judge_module.Judge, "judge", real)
    for learner in learners:
        learner.close()
    report = audit_run(ctx, do_replay=False)
    assert report.ok and report.deltas_ignored == 1 and report.deltas_lost == 3, report.problems

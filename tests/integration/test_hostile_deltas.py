"""Hostile input: pickled, corrupted, wrong-model, NaN, lying and oversized deltas are rejected
with a reason, nothing is executed, and the merger keeps merging the good ones.
Run: .venv/bin/pytest tests/integration/test_hostile_deltas.py -q
"""

from __future__ import annotations

import os
import pickle

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
    cfg = load_config("tiny").with_overrides({"run.num_learners": 1, "merger.quorum": 1, "merger.grace_cap_s": 0.0,
                                              "merger.max_delta_bytes": 2_000_000})
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
        admit_learner(ctx, None, name)  # admitted writers: what the codec and validation refuse, not admission
        ctx.store.put(ctx.keys.delta(name, 0), data)

    merger = Merger(ctx)
    merger.load()
    manifest = merger.merge_once()
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

"""Helpers of the trust tests: a tiny run driven in-process (real learners, a real merger, file:// storage)
and deltas planted in its bucket as a rogue writer would.

Not a test module; imported by tests/integration/test_trust.py and test_operate.py.
"""

from __future__ import annotations

from pathlib import Path

from diloco.configs import load_config
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.context import RunContext
from diloco.run.create import create_run
from diloco.run.events import EventLog
from diloco.run.objects import encode_tensors, read_tensors
from diloco.storage import Manifest, open_store

OVERRIDES = {"run.num_learners": 2, "merger.quorum": 2, "merger.grace_cap_s": 0.0,
             "merger.quorum_timeout_s": 5.0, "learner.local_state_every_steps": 0,
             "outer.lr": 0.7, "outer.momentum": 0.9}  # Nesterov momentum on, as the states replayed here need


def tiny_run(tmp_path: Path, run_id: str = "trust", keys: dict[str, bytes] | None = None,
             keyring: dict[str, list[bytes]] | None = None,
             **overrides) -> tuple[RunContext, list[Learner], Merger]:
    cfg = load_config("tiny").with_overrides({**OVERRIDES, **overrides})
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), run_id, cfg)
    learners = [Learner(ctx, n, events=EventLog(ctx.store, ctx.keys, n), signing_key=(keys or {}).get(n))
                for n in ctx.learners]
    for learner in learners:
        learner.join()
    merger = Merger(ctx, events=EventLog(ctx.store, ctx.keys, "merger"), keyring=keyring)
    merger.load()
    return ctx, learners, merger


def publish_all(learners: list[Learner]) -> None:
    for learner in learners:
        learner.run_phase()
        learner.publish()
        learner.publisher.drain()


def install_all(learners: list[Learner], version: int) -> None:
    for learner in learners:
        if version > learner.state.base:
            learner.install(version)


def one_round(learners: list[Learner], merger: Merger) -> Manifest:
    publish_all(learners)
    manifest = merger.merge_once()
    assert manifest is not None
    install_all(learners, manifest.version)
    return manifest


def plant(ctx: RunContext, learner: str, seq: int, *, like: tuple[str, int], scale: float,
          base: int) -> bytes:
    """A well-formed, finite delta under `learner`/`seq`: a real learner's delta `like` times `scale`."""
    header, delta = read_tensors(ctx.store, ctx.keys.delta(*like))
    meta = {**header.meta, "learner": learner, "seq": seq, "base_version": base}
    data = encode_tensors({k: v * scale for k, v in delta.items()}, codec_name="fp32", kind="delta",
                          fingerprint=ctx.fingerprint, meta=meta)
    ctx.store.put(ctx.keys.delta(learner, seq), data)
    return data


def decision(manifest: Manifest, learner: str, seq: int):
    (found,) = [d for d in manifest.decisions if d.learner == learner and d.seq == seq]
    return found

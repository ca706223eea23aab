"""The committed bits of a P = 1 run and of a P = 4 run on a fixed seed, pinned: a refactor of the engine
(issue #40: one learner over lanes, one merger loop over chains) must commit exactly these versions. Each
run is driven in one process in a fixed order (learners one after another, then every waiting delta
merged), so its versions depend only on the seed: the SHA-256 of every committed update object and of every
version's parameters must equal tests/integration/committed_bits.json. A version's parameters are read
through the one reader (diloco.run.chain_state: the checkpoint at or before it plus the updates after it),
however the run stores them.

Float kernels differ between CPU models (docs/BENCHMARKS.md: the machine), so the exact hashes are compared
where the golden file was written (same CPU model, torch and numpy); elsewhere the test compares each
version's parameters by their fp64 norm to 1e-6. Rewrite the golden file (only for a change that means to
change the math): DILOCO_WRITE_GOLDEN=1 .venv/bin/pytest tests/integration/test_committed_bits.py

Run: .venv/bin/pytest tests/integration/test_committed_bits.py   (about 15 s)
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.configs import load_config
from diloco.run.chain_state import chain_params
from diloco.run.context import open_run
from diloco.run.create import create_run
from diloco.run.fragments import fragment_context, num_fragments
from diloco.storage import list_versions, open_store, read_manifest

GOLDEN = Path(__file__).with_name("committed_bits.json")
ROUNDS = 4
OVERRIDES = {"run.num_learners": 2, "merger.quorum": 2, "inner.steps_per_phase": 8,
             "learner.probe_every_steps": 4,
             "inner.dylu": False, "learner.local_state_every_steps": 0, "learner.prefetch": False,
             "outer.momentum": 0.5, "outer.update_codec": "int4", "learner.codec": "int4"}


def machine() -> str:
    """What the exact bits depend on: the CPU model, torch and numpy."""
    model = platform.processor()
    with_cpuinfo = Path("/proc/cpuinfo")
    if with_cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in with_cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    return f"{model} | {platform.machine()} | torch {torch.__version__} | numpy {np.__version__}"


def _drive(tmp_path: Path, fragments: int) -> dict:
    """A run of ROUNDS rounds: each learner's phase in turn, then every waiting delta merged; the committed
    bits."""
    from diloco.learner.learner import Learner
    from diloco.merger.loop import ShardMerger

    cfg = load_config("tiny").with_overrides({**OVERRIDES, "fragments.count": fragments})
    url = f"file://{tmp_path}/p{fragments}"
    create_run(open_store(url), "pinned", cfg)
    ctx = open_run(url, "pinned")
    learners = [Learner(ctx, name) for name in ctx.learners]
    for learner in learners:
        learner.publisher.full = lambda *_: False  # a due ship waits for room: slow storage would defer it
        learner.join()
    merger = ShardMerger(ctx, 0)  # the run's one merger: the root chain at P = 1, every fragment's at P = 4
    for _ in range(ROUNDS):
        for learner in learners:
            learner.publish(learner.run_phase())
            learner.drain() if ctx.fragments else learner.publisher.drain()
        assert merger.merge_waiting() >= 1
        for learner in learners:
            learner.maybe_install()
    for learner in learners:
        learner.close()
    merger.close()
    chains = {}
    for index in range(num_fragments(ctx)):
        chain = fragment_context(ctx, index)
        rows = []
        for version in list_versions(ctx.store, chain.keys):
            manifest = read_manifest(ctx.store, chain.keys, version)
            tensors = chain_params(chain, manifest)
            digest = hashlib.sha256()
            for name, tensor in tensors.items():  # the version's global G_v, however it is stored
                digest.update(name.encode() + b"\0" + tensor.numpy().tobytes())
            norm = float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values())))
            update = ctx.store.get(manifest.update_key) if manifest.update_key else b""
            rows.append({"version": version, "params_sha256": digest.hexdigest(),
                         "update_sha256": hashlib.sha256(update).hexdigest(), "params_norm": norm,
                         "merged": sorted(f"{d.learner}/{d.seq}" for d in manifest.merged())})
        chains[str(index)] = rows
    return chains


@pytest.mark.parametrize("fragments", [1, 4])
def test_the_committed_versions_are_pinned(tmp_path: Path, fragments: int) -> None:
    got = _drive(tmp_path, fragments)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("DILOCO_WRITE_GOLDEN"):
        golden.setdefault("runs", {})[str(fragments)] = got
        golden["machine"] = machine()
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    want = golden["runs"][str(fragments)]
    assert sorted(got) == sorted(want)
    exact = golden["machine"] == machine()
    for chain, rows in want.items():
        assert [r["version"] for r in got[chain]] == [r["version"] for r in rows], chain
        for mine, theirs in zip(got[chain], rows, strict=True):
            assert mine["merged"] == theirs["merged"], (chain, mine["version"])
            if exact:
                assert (mine["params_sha256"], mine["update_sha256"]) == \
                    (theirs["params_sha256"], theirs["update_sha256"]), (chain, mine["version"])
            else:
                assert mine["params_norm"] == pytest.approx(theirs["params_norm"],
                                                            rel=1e-6), (chain, mine["version"])

"""A user's model with every awkward tensor (a 0-d gain, odd lengths, a 257-wide layer, an empty parameter, a
one-element bias as its last tensor) trains with every pair of delta codec and update codec, and audits bit
for bit; a learner that meets a corrupt committed object stops with an error naming it instead of training on
at version 0; the merger never commits an update it cannot read back.

Run: .venv/bin/pytest tests/integration/test_any_model.py   (about a minute on 2 cores)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from odd_spec_source import ODD_SPEC_SOURCE

from diloco.configs import load_config
from diloco.evaluator.evaluator import Evaluator
from diloco.inspect.audit import audit_run
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.run.objects import CorruptObject
from diloco.storage import open_store, read_latest
from diloco.storage.codec import CODECS
from diloco.storage.store import Store

pytestmark = pytest.mark.slow
OVERRIDES = {"inner.steps_per_phase": 8, "run.num_learners": 2, "learner.probe_every_steps": 4,
             "merger.quorum": 2, "outer.lr": 0.7, "outer.momentum": 0.5, "inner.lr": 0.01,
             "inner.warmup_steps": 2}


def write_spec(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "oddspec.py"
    path.write_text(ODD_SPEC_SOURCE)
    return path


def _train_in_process(tmp_path: Path, spec: Path, run_id: str, rounds: int, **extra) -> tuple:
    cfg = load_config("tiny").with_overrides({**OVERRIDES, "spec": f"{spec}:make_spec",
                                              "learner.local_state_every_steps": 0, **extra})
    ctx = create_run(open_store(f"file://{tmp_path}/store"), run_id, cfg)
    learners = [Learner(ctx, name) for name in ctx.learners]
    merger = Merger(ctx)
    merger.load()
    for learner in learners:
        learner.join()
    for _ in range(rounds):
        for learner in learners:
            learner.publish(learner.run_phase())
            learner.publisher.drain()
        assert merger.merge_once() is not None
        for learner in learners:
            for _ in range(500):  # a prefetcher's thread fetches it first
                if learner.maybe_install() is not None or learner.state.base == merger.version:
                    break
                time.sleep(0.01)
            assert learner.state.base == merger.version
    for learner in learners:
        learner.close()
    return ctx, merger


@pytest.mark.parametrize("delta_codec", CODECS)
def test_the_odd_model_trains_with_every_codec_pair_and_audits(tmp_path: Path, delta_codec: str) -> None:
    spec = write_spec(tmp_path / "user")
    for update_codec in CODECS:
        ctx, merger = _train_in_process(tmp_path, spec, f"odd-{delta_codec}-{update_codec}", rounds=3,
                                        **{"learner.codec": delta_codec, "outer.update_codec": update_codec})
        assert merger.version == 3
        evaluator = Evaluator(ctx)
        first, last = evaluator.evaluate_version(0)["loss"], evaluator.evaluate_version(3)["loss"]
        assert last < 0.8 * first, (delta_codec, update_codec, first, last)
        report = audit_run(ctx)
        assert report.ok and report.replay_ok, (delta_codec, update_codec, report.problems)


@pytest.mark.parametrize("fragments", [1, 3])
def test_the_odd_model_trains_through_the_command_line(tmp_path: Path, fragments: int) -> None:
    spec = write_spec(tmp_path / "elsewhere")
    storage = f"file://{tmp_path}/runs"
    done = subprocess.run(
        [sys.executable, "-m", "diloco.cli", "run", "--config", "tiny", "--spec", f"{spec}:make_spec",
         "--learners", "2",
         "--versions", "8", "--no-prefect", "--no-live", "--json", "--storage", storage, "--run-id", "odd",
         "-o", "merger.quorum=2", "-o", "inner.lr=0.01", "-o", f"fragments.count={fragments}"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["num_versions"] >= 8 and summary["final_eval_loss"] < 0.8 * summary["initial_eval_loss"]
    record = json.loads((tmp_path / "runs" / "odd" / "run.json").read_text())
    assert [(p["name"], p["shape"]) for p in record["layout"]][-3:] == [
        ("mid.bias", [257]), ("head.weight", [1, 257]), ("head.bias", [1])]
    assert ("gain", []) in [(p["name"], p["shape"]) for p in record["layout"]]
    audited = subprocess.run([sys.executable, "-m", "diloco.cli", "audit", "--storage", storage, "--run-id",
                              "odd"],
                             capture_output=True, text=True, timeout=300)
    assert audited.returncode == 0 and "replay ok" in audited.stdout, audited.stdout + audited.stderr


def _corrupt(store: Store, key: str) -> None:
    data = bytearray(store.get(key))
    data[-1] ^= 0xFF  # one flipped payload byte: the codec's crc refuses it
    store.put(key, bytes(data))


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_learner_stops_on_a_corrupt_update_naming_it(tmp_path: Path, prefetch: bool) -> None:
    spec = write_spec(tmp_path / "user")
    ctx, merger = _train_in_process(tmp_path, spec, "corrupt", rounds=1, **{"learner.prefetch": prefetch,
                                                                            "learner.prefetch_poll_s": 0.01})
    learner = Learner(ctx, "local-0")
    learner.join()
    learner.publish(learner.run_phase())
    other = Learner(ctx, "local-1")
    other.join()
    other.publish(other.run_phase())
    for one in (learner, other):
        one.publisher.drain()

    def damage(stage: str) -> None:  # after the writer checked the update, before the manifest makes it seen
        if stage == "before_manifest":  # (a prefetcher polling every 10 ms must not get the good bytes first)
            stem = ctx.keys.update(2, "0" * 8).rsplit("-", 1)[0]  # <chain>/global/<version 2>
            for key in ctx.store.list(ctx.keys.global_prefix()):
                if key.startswith(stem + "-") and key.endswith(".update"):
                    _corrupt(ctx.store, key)

    merger.stage_hook = damage
    manifest = merger.merge_once()
    merger.stage_hook = lambda stage: None
    # the bucket damaged it after the writer's check: the manifest's checksum is of the good bytes (a torn
    # read would pass on a retry; this never will)
    with pytest.raises(CorruptObject,
                       match=rf"version 2's update {manifest.update_key} is corrupt .*read 3 times"):
        # with a prefetcher the thread meets it first (slowly on a loaded machine), and the training thread
        # raises it
        deadline = time.time() + 120
        while time.time() < deadline:
            learner.maybe_install()
            if prefetch:
                learner.prefetcher._thread.join(0.02)
    learner.close()
    other.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_odd_model_trains_with_half_precision_parameters(tmp_path: Path, dtype: str) -> None:
    """Parameters held in bf16 or fp16 by the spec: deltas and versions are the canonical fp32 all the
    same."""
    ctx, merger = _train_in_process(tmp_path, write_spec(tmp_path / "user"), f"odd-{dtype}", rounds=3,
                                    spec_args={"dtype": dtype},
                                    **{"learner.codec": "int4", "outer.update_codec": "int4"})
    assert {p["dtype"] for p in ctx.layout} == {dtype}
    evaluator = Evaluator(ctx)
    first, last = evaluator.evaluate_version(0)["loss"], evaluator.evaluate_version(3)["loss"]
    assert last < 0.8 * first, (first, last)
    report = audit_run(ctx)
    assert report.ok and report.replay_ok, report.problems


def test_the_merger_commits_no_update_it_cannot_read_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = write_spec(tmp_path / "user")
    ctx, merger = _train_in_process(tmp_path, spec, "unreadable", rounds=1)
    for name in ctx.learners:
        learner = Learner(ctx, name)
        learner.join()
        learner.publish(learner.run_phase())
        learner.close()
    real_put = ctx.store.put

    def damaging_put(key: str, data: bytes) -> None:  # storage that damages what it stores
        real_put(key, bytes(data[:-1]) + bytes([data[-1] ^ 1]) if key.endswith(".update") else data)

    monkeypatch.setattr(ctx.store, "put", damaging_put)
    with pytest.raises(CorruptObject, match=r"the merger wrote version 2's update .* read it back corrupt"):
        merger.merge_once()
    assert read_latest(ctx.store, ctx.keys).version == 1  # nothing committed

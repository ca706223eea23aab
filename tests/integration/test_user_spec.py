"""Your own model through the TrainSpec seam: a user's MLP spec, written to a folder outside the repository,
trains through `diloco run --spec FILE.py:FN` and through `diloco.train` (held-out metric falls, audit
replays bit for bit); a restarted learner continues its data exactly where its state says (no batch replayed,
none skipped); the merger and audit run where the spec's module cannot be imported; a learner whose spec
builds another layout is refused; a non-finite loss never reaches a merge.

Run: .venv/bin/pytest tests/integration/test_user_spec.py   (about a minute on 2 cores: real processes)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from user_spec_source import SPEC_SOURCE

import diloco
from diloco.configs import load_config
from diloco.inspect.audit import audit_run
from diloco.merger.merger import Merger
from diloco.run.context import RunError, open_run
from diloco.run.create import create_run
from diloco.run.events import EventLog, read_events
from diloco.specs.loader import resolve
from diloco.storage import open_store

pytestmark = pytest.mark.slow
OVERRIDES = {"inner.steps_per_phase": 10, "run.num_learners": 2, "learner.probe_every_steps": 5}
# the real runs: quorum 2, and 5 ms per step (this MLP would step in microseconds, far faster than the merger
# merges: every merge a backlog of many rounds)


def write_spec(folder: Path, name: str = "myspec") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(SPEC_SOURCE)
    return path


def cli(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_a_user_spec_trains_through_the_cli(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "elsewhere")
    done = cli("run", "--config", "tiny", "--spec", f"{spec}:make_spec", "--spec-arg", "hidden=24",
               "--spec-arg", "step_s=0.005",
               "--learners", "2", "--versions", "10", "--no-prefect", "--no-live", "--json", "-o",
               "merger.quorum=2", "--storage", f"file://{tmp_path}/runs", "--run-id", "mlp")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["num_versions"] >= 10 and summary["extra"]["metric"] == "mse"
    extra = summary["extra"]  # a normal run: its target reached, nothing failed (exit 0 above)
    assert (extra["ended_by"], extra["short_of_target"], extra["failure"], extra["failed_learners"]) == (
        "target", False, None, [])
    assert summary["final_eval_loss"] < 0.85 * summary["initial_eval_loss"]
    record = json.loads((tmp_path / "runs" / "mlp" / "run.json").read_text())
    assert (record["config"]["spec"] == f"{spec}:make_spec"
            and record["config"]["spec_args"] == {"hidden": 24, "step_s": 0.005})
    assert [p["name"] for p in record["layout"]] == ["body.0.weight", "body.0.bias", "body.2.weight",
                                                     "body.2.bias"]
    audited = cli("audit", "--storage", f"file://{tmp_path}/runs", "--run-id", "mlp")
    assert audited.returncode == 0 and "replay ok" in audited.stdout, audited.stdout + audited.stderr


def test_a_user_spec_trains_through_the_python_api(tmp_path: Path) -> None:
    factory = resolve(f"{write_spec(tmp_path / 'api')}:make_spec")
    summary = diloco.train(factory, config="tiny", learners=2, versions=10, storage=f"file://{tmp_path}/runs",
                           run_id="api", spec_args={"hidden": 12, "step_s": 0.005}, time_limit_s=180,
                           overrides={"merger.quorum": 2})
    assert summary["run_id"] == "api" and summary["num_versions"] >= 10
    assert summary["final_eval_loss"] < 0.85 * summary["initial_eval_loss"]
    report = audit_run(open_run(f"file://{tmp_path}/runs", "api"))
    assert report.ok and report.replay_ok, report.problems


def _in_process_run(tmp_path: Path, spec_path: Path, **spec_args) -> tuple:
    cfg = load_config("tiny").with_overrides({**OVERRIDES, "spec": f"{spec_path}:make_spec",
                                              "spec_args": spec_args})
    ctx = create_run(open_store(f"file://{tmp_path}/store"), "inproc", cfg)
    return cfg, ctx


def test_a_restarted_learner_continues_its_data_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco.learner.learner import Learner

    monkeypatch.setenv("DILOCO_LOCAL_DIR", str(tmp_path / "local"))
    log = tmp_path / "batches.log"
    _, ctx = _in_process_run(tmp_path, write_spec(tmp_path / "restart"), log=str(log))
    first = Learner(ctx, "local-0", events=EventLog(ctx.store, ctx.keys, "local-0"))
    first.join()
    for _ in range(2):
        first.publish(first.run_phase())
    first.publisher.drain()
    # part of a third phase: 7 steps after the last publish, a local save at step 5 of them
    for _ in range(7):
        first.trainer.train_step(first._next_batch())
        first.state.steps_since_publish += 1
    first.save_local()
    first.local.flush()
    saved_cursor, saved_step = first.cursor, first.trainer.step
    first.publisher.abandon()  # a crash: no close, no flush
    second = Learner(ctx, "local-0", events=EventLog(ctx.store, ctx.keys, "local-0"))
    second.join()
    assert (second.cursor, second.trainer.step) == (saved_cursor, saved_step) == (27, 27)
    assert int(second._next_batch()["i"]) == saved_cursor  # the next batch is the one after the saved state's
    opens = [line.split()[1:] for line in log.read_text().splitlines()]  # (shard, num_shards, start) per open
    assert opens == [["0", "1", "0"], ["0", "2", "0"], ["0", "2", str(saved_cursor)]]  # the creator's probe,
    # the first learner from batch 0, the restarted one at its saved cursor: nothing replayed, nothing skipped
    assert second.state.steps_since_publish == 7  # the unshipped steps are carried, not redone
    second.close()


def test_the_merger_and_audit_need_no_user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco.learner.learner import Learner

    module_dir = tmp_path / "only-learners-have-this"
    write_spec(module_dir, "usermod_only_here")
    monkeypatch.syspath_prepend(str(module_dir))
    cfg = load_config("tiny").with_overrides({**OVERRIDES, "spec": "usermod_only_here:make_spec"})
    url = f"file://{tmp_path}/store"
    ctx = create_run(open_store(url), "nocode", cfg)
    for name in ctx.learners:
        learner = Learner(ctx, name)
        learner.join()
        learner.publish(learner.run_phase())
        learner.close()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([sys.executable, "-c",
                            "import usermod_only_here; print(usermod_only_here.__file__)"],
                           capture_output=True, env=env)
    assert probe.returncode != 0, probe.stdout  # the merger's environment cannot import the spec
    merged = subprocess.run([sys.executable, "-m", "diloco.launch", "merger", "--storage", url, "--run-id",
                             "nocode", "--merges", "1"], capture_output=True, text=True, env=env, timeout=180)
    assert merged.returncode == 0, merged.stderr[-2000:]
    audited = subprocess.run([sys.executable, "-m", "diloco.cli", "audit", "--storage", url, "--run-id",
                              "nocode"],
                             capture_output=True, text=True, env=env, timeout=180)
    assert (audited.returncode == 0
            and "audit OK: 2 versions" in audited.stdout), audited.stdout + audited.stderr


def test_a_learner_whose_spec_builds_another_layout_is_refused(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco.learner.learner import Learner

    _, ctx = _in_process_run(tmp_path, write_spec(tmp_path / "layout"))
    monkeypatch.setenv("USER_SPEC_HIDDEN", "17")  # the user's code changed since the run was created
    with pytest.raises(RunError, match=r"learner local-0: .*parameter 0 \('body.0.weight'\): shape \[17, 8\] "
                                       r"where the run has \[16, 8\]"):
        Learner(ctx, "local-0")


def test_a_non_finite_loss_never_reaches_a_merge(tmp_path: Path) -> None:
    from diloco.learner.learner import Learner

    _, ctx = _in_process_run(tmp_path, write_spec(tmp_path / "nan"), nan_at=14)
    learner = Learner(ctx, "local-0", events=EventLog(ctx.store, ctx.keys, "local-0"))
    learner.join()
    assert learner.publish(learner.run_phase()) == 0  # batches 0-9: fine
    bad = learner.run_phase()  # batch 14 gives NaN: the phase is abandoned
    assert bad.steps == 0 and learner.publish(bad) is None and learner.state.steps_since_publish == 0
    assert learner.publish(learner.run_phase()) == 1  # back at the newest version, seq and cursor go on
    learner.close()
    merger = Merger(ctx)
    merger.load()
    manifest = merger.merge_once()
    assert [d.seq for d in manifest.merged() if d.learner == "local-0"] == [0, 1]
    failed = [e for e in read_events(ctx.store, ctx.keys) if e["kind"] == "phase_failed"]
    assert len(failed) == 1 and "loss is nan" in failed[0]["reason"]

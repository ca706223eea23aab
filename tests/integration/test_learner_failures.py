"""Learner failures reach the user, with real processes: a run whose learners build another layout than the
run's (the user's code changed since it was created) exits with EXIT_CODE, each learner's error line and log
path on the terminal, in `diloco status` and in `diloco summary` (read later, from the bucket alone);
`diloco.train` raises `diloco.RunFailed` with the summary when the learners cannot import the spec; a time
limit that ends a healthy run short says so in one line and in the JSON, and exits 0; the traffic headline
counts every byte the learners moved.

Run: .venv/bin/pytest tests/integration/test_learner_failures.py   (about a minute on 2 cores: real processes)
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
from diloco import api
from diloco.inspect.outcome import EXIT_CODE
from diloco.specs.loader import resolve

pytestmark = pytest.mark.slow
LAYOUT = "shape [17, 8] where the run has [16, 8]"


def write_spec(folder: Path, source: str = SPEC_SOURCE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "myspec.py"
    path.write_text(source)
    return path


def cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli", *args], capture_output=True, text=True,
                          timeout=180,
                          cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200",
                                        **(env or {})})


def test_learners_that_build_another_layout_fail_the_run_loudly(tmp_path: Path) -> None:
    spec, url = write_spec(tmp_path / "elsewhere"), f"file://{tmp_path}/runs"
    flags = {"run.num_learners": 2, "run.num_versions": 10, "run.storage": url, "spec": f"{spec}:make_spec"}
    api.create(api.resolve_config("tiny", flags), "changed")  # created with the user's code as it was
    done = cli("run", "--config", "tiny", "--spec", f"{spec}:make_spec", "--learners", "2", "--versions",
               "10", "--no-prefect", "--no-live", "--json", "--storage", url, "--run-id", "changed",
               cwd=tmp_path, env={"USER_SPEC_HIDDEN": "17"})  # ... and the learners run it changed
    assert done.returncode == EXIT_CODE, done.stderr[-3000:]
    log = tmp_path / ".diloco" / "logs" / "changed" / "local-0.log"
    assert f"learner local-0 failed; a restart cannot fix it: learner local-0: the spec builds another " \
           f"model than run 'changed': parameter 0 ('body.0.weight'): {LAYOUT} (log: {log})" in done.stderr, \
        done.stderr[-3000:]
    assert "run changed failed: learners local-0, local-1 failed, and a restart cannot fix it" in done.stderr
    assert LAYOUT in log.read_text()  # the log says it too
    extra = json.loads(done.stdout.strip().splitlines()[-1])["extra"]
    assert extra["ended_by"] == "learners crashed" and extra["short_of_target"] and LAYOUT in extra["failure"]
    assert [(f["learner"], f["fatal"], f["given_up"], f["log"]) for f in extra["failed_learners"]] == [
        ("local-0", True, True, str(log)), ("local-1", True, True, str(log).replace("local-0", "local-1"))]

    status = cli("status", "--storage", url, "--run-id", "changed", cwd=tmp_path)  # what the live table shows
    assert status.returncode == 0 and "failed" in status.stdout, status.stderr
    words = " ".join(status.stdout.split())  # the lines under the table wrap at its width
    assert "learner local-1 failed; a restart cannot fix it, left down: learner local-1: the spec builds " \
           "another model" in words and "(log: .diloco/logs/changed/local-1.log)" in words, status.stdout
    # from the bucket alone
    later = cli("summary", "--storage", url, "--run-id", "changed", "--json", cwd=tmp_path)
    assert later.returncode == 0, later.stderr
    assert json.loads(later.stdout.strip().splitlines()[-1])["extra"]["failure"] == extra["failure"]
    assert str(log) in later.stderr and "run failed" in later.stderr


def test_diloco_train_raises_run_failed_when_the_learners_cannot_import_the_spec(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = write_spec(tmp_path / "api", 'import os\nif os.environ.get("USER_SPEC_BROKEN"):\n'
                                          '    raise ImportError("No module named \'torchvision\'")\n'
                                          + SPEC_SOURCE)
    factory = resolve(f"{broken}:make_spec")  # this process imported it before the hosts lost the package
    monkeypatch.setenv("USER_SPEC_BROKEN", "1")
    monkeypatch.chdir(tmp_path)  # the run's logs: .diloco/logs/<run>/ here
    with pytest.raises(diloco.RunFailed,
                       match="a restart cannot fix it: .*could not be imported: ImportError: "
                             "No module named 'torchvision'") as caught:
        diloco.train(factory, config="tiny", learners=1, versions=10, storage=f"file://{tmp_path}/runs",
                     run_id="noimport", time_limit_s=120)
    summary = caught.value.summary
    assert summary["run_id"] == "noimport" and summary["num_versions"] == 0 and summary["deltas_merged"] == 0
    failed = summary["extra"]["failed_learners"]
    assert ([f["learner"] for f in failed] == ["local-0"]
            and failed[0]["log"].endswith("logs/noimport/local-0.log"))


def test_a_time_limit_that_ends_a_healthy_run_short_says_so_and_exits_0(tmp_path: Path) -> None:
    spec, url = write_spec(tmp_path / "spec"), f"file://{tmp_path}/runs"
    done = cli("run", "--config", "tiny", "--spec", f"{spec}:make_spec", "--spec-arg", "step_s=0.005",
               "--learners", "2", "--versions", "100000", "--time-limit-s", "15", "--no-prefect", "--no-live",
               "--json", "--storage", url, "--run-id", "short", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("the time limit (run.time_limit_s = 15 s) ended the run short of its target: version"
            in done.stderr)
    assert "run short failed" not in done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    extra = summary["extra"]
    assert (extra["ended_by"], extra["short_of_target"], extra["failure"]) == ("time limit", True, None)
    assert summary["deltas_merged"] > 0
    sent = sum(r["bytes_sent"] for r in extra["learners"])  # every byte the learners sent: the headline
    received = sum(r["bytes_received"] for r in extra["learners"])
    assert extra["traffic_ratio_vs_dp"] == pytest.approx(extra["dp_bytes_equivalent"] / sent)
    assert extra["received_ratio_vs_dp"] == pytest.approx(extra["dp_bytes_equivalent"] / received)
    assert extra["delta_traffic_ratio_vs_dp"] == pytest.approx(extra["dp_bytes_equivalent"]
                                                               / summary["bytes_published"])
    assert extra["delta_traffic_ratio_vs_dp"] > extra["traffic_ratio_vs_dp"]  # the deltas are not all it sent
    assert "less sent" in done.stderr and "counting every byte (deltas only:" in done.stderr


def test_learners_that_cannot_install_the_newest_version_fail_the_run_loudly(tmp_path: Path) -> None:
    """The bucket damaged the newest version after it was committed (a flipped byte in its update, as a disk
    or a provider might): learners that resume the run cannot install it (its checkpoint and the updates
    after it), say which object, and the run exits with EXIT_CODE instead of training on at an old version.
    (Learners on new hosts: no local state, which would let them go on from their own copy of the version;
    the merger cannot load it either.)"""
    url = f"file://{tmp_path}/runs"
    first = cli("run", "--config", "tiny", "--learners", "2", "--versions", "3", "--no-prefect", "--no-live",
                "--storage", url, "--run-id", "rot", "-o", "learner.local_state_every_steps=0", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    from diloco.run.context import open_run
    from diloco.storage import read_latest

    ctx = open_run(url, "rot")
    newest = read_latest(ctx.store, ctx.keys)
    for key in (newest.update_key,):
        data = bytearray(ctx.store.get(key))
        data[-1] ^= 0xFF
        ctx.store.put(key, bytes(data))
    done = cli("resume", "--storage", url, "--run-id", "rot", "--versions", "3", "--no-live", "--json",
               cwd=tmp_path)
    assert done.returncode == EXIT_CODE, done.stderr[-3000:]
    words = " ".join(done.stderr.split())  # the console wraps at its width
    assert f"version {newest.version}'s update {newest.update_key} is corrupt" in words, words[-3000:]
    assert "a restart cannot fix it" in words

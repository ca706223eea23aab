"""End to end, as a user runs it: `diloco run` (real processes) on file:// and on the real S3
server, then `diloco audit` and `diloco status`; held-out loss must fall.
Run: .venv/bin/pytest tests/e2e -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

pytestmark = pytest.mark.slow


def _diloco(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return subprocess.run([sys.executable, "-m", "diloco.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def _run_and_audit(storage: str, run_id: str, *overrides: str) -> dict:
    # 20 versions: with quorum 1 each merge carries about a third of a round (partial-round scaling),
    # and a burst of single-delta merges can overshoot for a few versions before the learners' next
    # deltas pull the model back (docs/ENGINE.md, known problems: seen once at version 10 in CI)
    result = _diloco("run", "--config", "tiny", "--learners", "3", "--versions", "20", "--storage", storage,
                     "--run-id", run_id, "--no-prefect", "--no-live", "--json", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = _last_json(result.stdout)
    assert summary["run_id"] == run_id and summary["num_learners"] == 3
    assert summary["num_versions"] >= 20
    assert summary["deltas_merged"] >= 5
    # falls: by how much depends on the machine's load (merges of fewer deltas)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.1
    assert summary["bytes_published"] > 0
    audit = _diloco("audit", "--storage", storage, "--run-id", run_id, "--json")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    report = _last_json(audit.stdout)
    assert report["ok"] and report["replay_ok"] and report["num_versions"] >= 21, report
    status = _diloco("status", "--storage", storage, "--run-id", run_id, "--json")
    assert status.returncode == 0, status.stderr
    learners = {row["learner"] for row in _last_json(status.stdout)["learners"]}
    assert learners == {"local-0", "local-1", "local-2"}
    return summary


def _no_leftovers(run_id: str) -> None:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        assert not (run_id in cmdline and "diloco" in cmdline), f"left behind: {cmdline}"


def test_run_on_local_disk(tmp_path):
    _run_and_audit(f"file://{tmp_path}/bucket", "e2e-file")
    _no_leftovers("e2e-file")


@pytest.mark.s3
# ~40 s on moto; make test covers S3 in tests/integration (conformance, races, policies, rejoin);
@pytest.mark.long
# the same run on file:// stays in make test
def test_run_on_s3(s3_url):
    # tiny's own 10-step phases: three learners would publish ~15-20 deltas/s on 2 cores, more than moto (one
    # Python process) serves the merger's reads of. learner.max_unmerged holds each learner to 4 deltas not
    # merged yet (the rest of its progress ships with a later delta), so the merger keeps up: without it the
    # run stopped at its 120 s limit at version 8-15, each version merging a growing backlog (docs/ENGINE.md,
    # "Back-pressure").
    summary = _run_and_audit(s3_url, "e2e-s3")
    assert summary["deltas_merged"] <= 20 * 3 * 4  # no backlog: at most max_unmerged per learner a version
    assert summary["storage"].startswith("s3://")
    _no_leftovers("e2e-s3")


def test_bad_input_is_one_clear_line(tmp_path):
    storage = f"file://{tmp_path}/bucket"
    cases = [
        (("run", "--config", "nope", "--storage", storage), "nope"),
        (("run", "--config", "tiny", "--learners", "0", "--storage", storage), "run.num_learners"),
        (("run", "--config", "tiny", "--run-id", "../escape", "--storage", storage), "run id"),
        (("learner", "--storage", storage, "--run-id", "missing", "--learner", "Bad/Name"), "learner"),
        (("audit", "--storage", storage, "--run-id", "missing"), "no run"),
        (("run", "--config", "tiny", "--corpus", str(tmp_path / "absent.txt"), "--storage", storage),
         "corpus"),
    ]
    for args, needle in cases:
        result = _diloco(*args, timeout=60)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert needle.lower() in result.stderr.lower(), (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "bucket").exists() or not any((tmp_path / "bucket").iterdir())

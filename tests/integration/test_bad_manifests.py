"""A bad newest manifest ends nothing and is installed by no one (issue #44, invariant 3): the newest version
is the top of the consecutive versions whose manifest parses and chains to its parent. A junk
`versions/<99999>.json` or a forged well-formed one planted in a live run leaves its learners, merger and
supervisor on the real chain to its target, and `diloco status` names the key; an unreadable manifest at the
top of the chain is stepped over by every reader of the newest version.

Run: .venv/bin/pytest tests/integration/test_bad_manifests.py   (about 30 s on 2 cores: real processes)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.configs import load_config
from diloco.run.context import open_run
from diloco.run.create import create_run
from diloco.run.fragments import ChainWatch, chain_report
from diloco.run.target import Target, target_reached
from diloco.storage import latest_version, open_store, read_latest, read_manifest
from diloco.supervise.core import Supervisor

pytestmark = pytest.mark.slow


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli", *args], capture_output=True, text=True,
                          timeout=240, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})


def test_junk_and_forged_manifests_above_the_chain_end_nothing(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/runs"
    run = subprocess.Popen([sys.executable, "-m", "diloco.cli", "run", "--config", "tiny", "--learners", "2",
                            "--versions", "8", "--no-prefect", "--no-live", "--json", "--storage", url,
                            "--run-id", "j"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    store = open_store(url)
    deadline = time.time() + 120
    while time.time() < deadline and not store.exists("j/versions/00000000000000000001.json"):
        time.sleep(0.2)
    ctx = open_run(url, "j")
    forged = read_manifest(ctx.store, ctx.keys, 1).model_copy(update={"version": 99998, "parent": 99997})
    store.put(ctx.keys.manifest(99998), forged.to_bytes())  # well-formed, but nothing chains to it
    store.put(ctx.keys.manifest(99999), b"junk")
    out, err = run.communicate(timeout=240)
    assert run.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["extra"]["ended_by"] == "target" and 8 <= summary["num_versions"] < 99998
    assert latest_version(ctx.store, ctx.keys) == summary["num_versions"]
    for name in ctx.learners:  # no learner installed a forged version
        status = json.loads(store.get(ctx.keys.status(name)))
        assert status["base_version"] < 99998
    status = cli("status", "--storage", url, "--run-id", "j", cwd=tmp_path)
    words = " ".join(status.stdout.split())
    assert status.returncode == 0 and f"not a version: {ctx.keys.manifest(99998)}: above a gap" in words
    assert f"not a version: {ctx.keys.manifest(99999)}: above a gap" in words


def test_an_unreadable_newest_manifest_is_stepped_over(tmp_path: Path) -> None:
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "s", load_config("tiny"))
    version0 = read_manifest(ctx.store, ctx.keys, 0)
    ctx.store.put(ctx.keys.manifest(1), b"{not json")  # at the next version: junk where a commit belongs
    assert latest_version(ctx.store, ctx.keys) == 1  # the listing's top ...
    assert read_latest(ctx.store, ctx.keys) == version0  # ... but no reader takes it
    assert chain_report(ctx) == [f"{ctx.keys.manifest(1)}: unreadable (manifest is not valid JSON: Expecting "
                                 "property name enclosed in double quotes: line 1 column 2 (char 1)); "
                                 "stepped over"]
    ctx.store.put(ctx.keys.manifest(2), version0.model_copy(update={"version": 2, "parent": 0}).to_bytes())
    assert read_latest(ctx.store, ctx.keys) == version0 and len(chain_report(ctx)) == 2  # 2 names 0, not 1
    watch = ChainWatch(ctx)
    assert not target_reached(ctx, target=Target(2), watch=watch)  # the supervisor's check: not on these


def test_the_supervisor_never_ends_a_run_on_a_stray_manifest(tmp_path: Path) -> None:
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "t", load_config("tiny").with_overrides(
        {"run.num_versions": 50}))
    ctx.store.put(ctx.keys.manifest(99999), b"junk")
    supervisor = Supervisor(ctx, backend=None)  # its target check only: no process is started
    assert not supervisor.target_reached() and supervisor.latest() == 0

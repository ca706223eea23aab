"""A fragmented, sharded run end to end: `diloco run --config tiny -o fragments.count=4 -o merger.shards=2`
starts two merger shards (merger, merger-s1) and learners that ship fragments; every fragment chain reaches
the target, `diloco audit` replays every chain clean, and the summary and evals see the run's version.

Run: .venv/bin/pytest tests/integration/test_fragment_run.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

from diloco.run.context import open_run
from diloco.run.fragments import fragment_versions, run_version
from diloco.storage import list_versions, read_manifest


def _diloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli", *args], capture_output=True, text=True,
                          timeout=240)


def test_fragmented_sharded_run_audits_clean(tmp_path):
    storage = f"file://{tmp_path}/runs"
    done = _diloco("run", "--config", "tiny", "--storage", storage, "--run-id", "frag", "--no-prefect",
                   "--no-live",
                   "--json", "--learners", "2", "--versions", "3", "-o", "fragments.count=4", "-o",
                   "merger.shards=2")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    ctx = open_run(storage, "frag")
    assert len(ctx.fragments) == 4 and run_version(ctx) >= 3 and list_versions(ctx.store, ctx.keys) == [0]
    assert summary["num_versions"] == run_version(ctx) and summary["deltas_merged"] > 0
    assert summary["extra"]["state"] == "finished"
    writers = {read_manifest(ctx.store, ctx.keys.for_fragment(p), 1).merger_id for p in range(4)}
    assert writers == {"merger", "merger-s1"}
    for p, version in enumerate(fragment_versions(ctx)):  # shard p % 2 wrote fragment p's chain
        keys = ctx.keys.for_fragment(p)
        assert {read_manifest(ctx.store, keys, v).merger_id for v in range(1, version + 1)} == \
            {"merger" if p % 2 == 0 else "merger-s1"}
    audit = _diloco("audit", "--storage", storage, "--run-id", "frag", "--json")
    assert audit.returncode == 0, audit.stderr[-2000:]
    report = json.loads(audit.stdout.strip().splitlines()[-1])
    assert (report["ok"] and report["replay_ok"]
            and report["decisions_replayed"] == report["deltas_merged"] > 0)
    assert len(report["fragment_versions"]) == 4

"""Deployments for real: a Prefect server, a process worker per pool, `prefect deploy --all` from
prefect.yaml and `prefect deployment run 'train/train'` on file:// storage — versions, what the API
shows, self-healing of a killed learner, and a clean stop.

Run: .venv/bin/pytest -m deployment tests/deployment   (a few minutes on 2 cores; real processes)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect_stack import DeployedRun, latest_version, pools, prefect_yaml, stop_run, wait_for
from removal import check_removal

pytestmark = [pytest.mark.deployment, pytest.mark.timeout(900)]
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def flow_runs(run: DeployedRun, *tags: str) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with run.client() as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=list(tags))))


def artifacts(run: DeployedRun, key: str) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with run.client() as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def test_prefect_yaml_has_a_learner_per_region_and_a_control_pool() -> None:
    by_name = {d["name"]: d for d in prefect_yaml()["deployments"]}
    learners = [d for d in by_name.values() if d["entrypoint"].endswith("learner.py:learner_flow")]
    assert len({d["work_pool"]["name"] for d in learners}) >= 2
    assert all(d["work_pool"]["name"].startswith("region-") for d in learners)
    for name in ("outer-merge", "evaluate", "train"):
        assert by_name[name]["work_pool"]["name"] == "control"
    assert "control" in pools()


def test_deploy_all_registers_every_deployment_on_its_pool(deployed_run: DeployedRun) -> None:
    with deployed_run.client() as client:
        deployed = {}
        for d in client.read_deployments():
            deployed[f"{client.read_flow(d.flow_id).name}/{d.name}"] = d.work_pool_name
    assert deployed == {"learner/learner-us-east": "region-us-east",
                        "learner/learner-eu-west": "region-eu-west",
                        "outer-merge/outer-merge": "control", "evaluate/evaluate": "control",
                        "train/train": "control", "operate/operate": "control"}


def test_run_reaches_versions_and_is_visible_through_the_api(deployed_run: DeployedRun) -> None:
    from diloco.tasks.common import artifact_key

    assert latest_version(deployed_run) >= 3
    runs = flow_runs(deployed_run, f"run:{deployed_run.run_id}")
    names = {r.name for r in runs}
    assert {f"train-{deployed_run.run_id}", f"merge-{deployed_run.run_id}", "us-east-0", "eu-west-0"} <= names
    learners = flow_runs(deployed_run, f"run:{deployed_run.run_id}", "role:learner")
    assert {t for r in learners for t in r.tags if t.startswith("region:")} == {"region:us-east",
                                                                                 "region:eu-west"}
    merge_tables = artifacts(deployed_run, artifact_key("merge", deployed_run.run_id))
    assert merge_tables and merge_tables[0].type == "table"
    assert artifacts(deployed_run, artifact_key("progress", deployed_run.run_id))


def test_killed_learner_is_resubmitted_and_rejoins_at_the_newest_version(deployed_run: DeployedRun) -> None:
    from diloco.run.events import read_events

    ctx = deployed_run.context()
    name = "us-east-0"
    status = wait_for(lambda: _status(ctx, name), 120, f"a heartbeat of {name}")
    os.kill(int(status["pid"]), signal.SIGKILL)

    def resubmitted() -> list | None:
        runs = flow_runs(deployed_run, f"learner:{name}")
        return runs if len(runs) >= 2 else None

    runs = wait_for(resubmitted, 180, f"a second flow run of {name}")
    assert any(r.state and r.state.type.value == "CRASHED" for r in runs)

    def rejoined() -> dict | None:
        joins = [e for e in read_events(ctx.store, ctx.keys)
                 if e.get("kind") == "join" and e.get("source") == name and e.get("pid") != status["pid"]]
        return joins[-1] if joins else None

    join = wait_for(rejoined, 240, f"{name} to rejoin")
    assert join["version"] > 0
    kinds = [e["kind"] for e in read_events(ctx.store, ctx.keys)
             if e.get("source") == "supervisor" and e.get("learner") == name]
    assert "exit" in kinds and "restart" in kinds


@pytest.mark.long  # ~75 s under load; make test covers removal on the local path and of a deployed run
def test_a_removed_learner_of_a_local_prefect_run_stays_ended(
        deployed_run: DeployedRun, tmp_path: Path) -> None:
    """`diloco run` with Prefect: local processes running the flows; before, the local supervisor
    started the removed learner's flow again and again."""
    env = {k: v for k, v in deployed_run.stack.env.items() if k.startswith("PREFECT_")}
    check_removal(tmp_path, prefect=True, env=env)


def test_a_removed_learner_of_the_deployed_run_stays_ended(deployed_run: DeployedRun) -> None:
    from diloco.run.events import read_events

    name = "eu-west-0"
    subprocess.run([sys.executable, "-m", "diloco.cli", "remove-learner", "--storage", deployed_run.storage,
                    "--run-id", deployed_run.run_id, "--learner", name], check=True, timeout=120)
    wait_for(lambda: all(r.state and r.state.type.value in FINAL
                         for r in flow_runs(deployed_run, f"learner:{name}")),
             240, f"the flow runs of {name} to end")
    ended = len(flow_runs(deployed_run, f"learner:{name}"))
    time.sleep(10)  # several supervisor ticks and back-offs
    assert len(flow_runs(deployed_run, f"learner:{name}")) == ended, "the removed learner was submitted again"
    ctx = deployed_run.context()
    kinds = [e["kind"] for e in read_events(ctx.store, ctx.keys)
             if e.get("source") == "supervisor" and e.get("learner") == name]
    assert "removed" in kinds


def test_stop_ends_every_flow_run_and_the_run_plots(deployed_run: DeployedRun, tmp_path: Path) -> None:
    assert stop_run(deployed_run, timeout_s=180) == "COMPLETED"
    wait_for(lambda: all(r.state and r.state.type.value in FINAL
                         for r in flow_runs(deployed_run, f"run:{deployed_run.run_id}")), 120,
             "every flow run of the run to end")
    out = tmp_path / "run.png"
    subprocess.run([sys.executable, "-m", "diloco.cli", "plot", "--storage", deployed_run.storage,
                    "--run-id", deployed_run.run_id, "--out", str(out)], check=True, timeout=180)
    assert out.stat().st_size > 10_000


def _status(ctx, name: str) -> dict | None:
    import json

    from diloco.storage import NotFound

    try:
        status = json.loads(ctx.store.get(ctx.keys.status(name)))
    except NotFound:
        return None
    return status if status.get("pid") else None

"""The Prefect side of the run lifecycle, against real servers and workers:

- SIGTERM to `diloco run` with Prefect and no PREFECT_API_URL (what `make run` does): every process of the
  run ends — its local Prefect server too — the reason is recorded, the summary printed, exit 143; while it
  ran, the learners', merger's and evaluator's flow runs were subflows of the `train` flow run.
- SIGINT to `diloco run` reporting to the session's shared server: exit 130, every flow run of the run ends.
- A learner deployment that does not exist fails the `train` flow (deployment mode) with the reason in the
  flow run's own logs, after the supervisor's bounded retries (MAX_REFUSALS).
- A run whose every learner crashes (run.max_restarts times in a row) ends its `train` flow run Failed, not
  Completed, with the reason.

Run: .venv/bin/pytest tests/deployment/test_signals_prefect.py   (~20 s for SIGTERM, which starts its own
server; the other two start the shared stack first)
"""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import psutil
import pytest
from prefect_stack import DeployedRun, wait_for
from run_signals import check_signal_ends_the_run, start_run, training, write_config  # tests/chaos (conftest)

from diloco.supervise.core import LEARNERS_CRASHED, MAX_REFUSALS

pytestmark = [pytest.mark.deployment, pytest.mark.timeout(1200)]


def _flow_runs(api_url: str, run_id: str) -> list:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with SyncPrefectClient(api_url) as client:
        return client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run_id}"])))


def _parents(api_url: str, runs: list) -> dict[str, str | None]:
    """flow-run name -> the name of the flow run its parent task run belongs to."""
    from prefect.client.orchestration import SyncPrefectClient

    names = {r.id: r.name for r in runs}
    out = {}
    with SyncPrefectClient(api_url) as client:
        for r in runs:
            parent = client.read_task_run(r.parent_task_run_id).flow_run_id if r.parent_task_run_id else None
            out[r.name] = names.get(parent, str(parent) if parent else None)
    return out


def test_sigterm_ends_a_prefect_run_and_its_local_server(tmp_path: Path) -> None:
    run_id = "sig-prefect-term"
    env = {"PREFECT_API_URL": None}  # unset for the child: it starts its own server, as `make run` does
    proc = start_run(tmp_path, write_config(tmp_path), run_id, env=env, prefect=True)
    record = tmp_path / ".diloco" / "prefect" / "server.json"
    try:
        wait_for(lambda: record.exists() and training(tmp_path, run_id), 600,
                 "the local server and version 2")
        server = json.loads(record.read_text())
        wait_for(lambda: len(_flow_runs(server["api_url"], run_id)) >= 4, 120, "the roles' flow runs")
        parents = _parents(server["api_url"], _flow_runs(server["api_url"], run_id))
        train = f"train-{run_id}"
        assert parents.pop(train) is None
        assert parents and set(parents.values()) == {train}, parents  # local-0, local-1, merge-…, evaluate-…
        check_signal_ends_the_run(tmp_path, proc, run_id, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (not psutil.pid_exists(server["pid"])
            or psutil.Process(server["pid"]).status() == psutil.STATUS_ZOMBIE)
    assert not record.exists()


def test_sigint_ends_a_prefect_run_reporting_to_a_shared_server(
        deployed_run: DeployedRun, tmp_path: Path) -> None:
    run_id = "sig-prefect-int"
    api = deployed_run.stack.api_url
    proc = start_run(tmp_path, write_config(tmp_path), run_id, env={"PREFECT_API_URL": api}, prefect=True)
    try:
        wait_for(lambda: training(tmp_path, run_id), 600, "version 2")
        check_signal_ends_the_run(tmp_path, proc, run_id, signal.SIGINT)
    finally:
        if proc.poll() is None:
            proc.kill()
    final = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}
    try:
        wait_for(lambda: all(r.state and r.state.type.value in final for r in _flow_runs(api, run_id)), 120,
                 "every flow run of the run to end")
    except TimeoutError as err:
        states = {r.name: r.state.type.value if r.state else None for r in _flow_runs(api, run_id)}
        raise AssertionError(f"{err}: {states}") from None
    states = {r.name: r.state.type.value for r in _flow_runs(api, run_id)}
    assert states[f"train-{run_id}"] == "COMPLETED", states


def test_a_missing_deployment_fails_the_train_flow_with_its_reason(
        deployed_run: DeployedRun, tmp_path: Path) -> None:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from diloco.run.context import open_run
    from diloco.run.signals import read_stop_reason

    stack, storage, run_id = deployed_run.stack, f"file://{tmp_path}/bucket", "missing-deployment"
    done = stack.cli("deployment", "run", "train/train", "-p", f"storage={storage}", "-p", f"run_id={run_id}",
                     "-p", "mode=deployments", "-p", "config=tiny",
                     "-p", 'learners={"us-east-0": "learner-nope"}',
                     "-p", 'overrides={"run.num_versions": 1000, "run.time_limit_s": 600, '
                           '"run.restart_backoff_s": 0.5}')
    flow_run_id = next(line.split("UUID:")[1].strip() for line in done.stdout.splitlines() if "UUID:" in line)

    def final_state() -> str | None:
        with SyncPrefectClient(stack.api_url) as client:
            state = client.read_flow_run(flow_run_id).state
        return state.type.value if state and state.is_final() else None

    def log_text() -> str:
        with SyncPrefectClient(stack.api_url) as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return "\n".join(log.message for log in logs)

    wait_for(final_state, 600, "the train flow run to end")
    assert final_state() == "FAILED"
    # Prefect ships a run's logs in batches after the fact: the FAILED state can be on the server before the
    # last batch (the exception that ended the run). Wait for that line rather than read the logs once.
    bound = f"could not be started {MAX_REFUSALS} times in a row"
    with contextlib.suppress(TimeoutError):  # the assertion below names what is missing
        wait_for(lambda: bound in log_text(), 60, "the run's last logs to reach the server")
    text = log_text()
    assert "learner/learner-nope" in text and "could not start us-east-0" in text, text  # each refusal, here
    assert bound in text, text  # the bound, then the end
    assert read_stop_reason(open_run(storage, run_id)).startswith("error: RoleUnstartable")


def test_a_run_whose_learners_all_crash_fails_the_train_flow(
        deployed_run: DeployedRun, tmp_path: Path) -> None:
    """Its learners' flow runs fail at once (learner.device cuda on a worker without CUDA, which only `diloco
    run` refuses up front); the supervisor gives each up after run.max_restarts and the run ends. Before, the
    `train` flow run ended Completed, the reason only in its logs."""
    from prefect.client.orchestration import SyncPrefectClient

    from diloco.run.context import open_run
    from diloco.run.signals import read_stop_reason

    stack, storage, run_id = deployed_run.stack, f"file://{tmp_path}/bucket", "learners-crash"
    done = stack.cli("deployment", "run", "train/train", "-p", f"storage={storage}", "-p", f"run_id={run_id}",
                     "-p", "mode=deployments", "-p", "config=tiny",
                     "-p", 'learners={"us-east-0": "learner-us-east"}',
                     "-p", 'overrides={"run.num_learners": 1, "learner.device": "cuda", "run.max_restarts": '
                           '0, "run.num_versions": 1000, "run.time_limit_s": 600, '
                           '"run.restart_backoff_s": 0.5}')
    flow_run_id = next(line.split("UUID:")[1].strip() for line in done.stdout.splitlines() if "UUID:" in line)

    def final_state():
        with SyncPrefectClient(stack.api_url) as client:
            state = client.read_flow_run(flow_run_id).state
        return state if state and state.is_final() else None

    wait_for(final_state, 600, "the train flow run to end")
    state = final_state()
    assert state.type.value == "FAILED" and LEARNERS_CRASHED in (state.message or ""), state
    assert read_stop_reason(open_run(storage, run_id)) == LEARNERS_CRASHED

"""The deployment supervisor's decisions without a server: placement of learners on regions, re-submission
of crashed and silent learners (bounded, with back-off), operator removal, a busy API.

Run: .venv/bin/pytest tests/deployment/test_deployed_supervisor.py   (fast: a fake Prefect client)
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from diloco.configs import load_config
from diloco.run.events import read_events
from diloco.run.context import RunContext, create_run
from diloco.supervise.deployments import (
    DeploymentSupervisor,
    make_jobs,
    placement,
    regional_names,
    request_remove,
)
from diloco.storage import open_store


class FakeClient:
    """Flow-run states by id, as the tests set them; records cancellations."""

    def __init__(self, live: dict[str, uuid.UUID] | None = None) -> None:
        self.states: dict[uuid.UUID, str] = {}
        self.cancelled: list[uuid.UUID] = []
        self.live = live or {}  # a live flow run per tag, left by an earlier supervisor

    def read_flow_runs(self, flow_run_filter: object, **kwargs: object) -> list[SimpleNamespace]:
        tags = flow_run_filter.tags.all_
        return [SimpleNamespace(id=fid) for tag, fid in self.live.items() if tag in tags]

    def read_flow_run(self, flow_run_id: uuid.UUID) -> SimpleNamespace:
        return SimpleNamespace(state=SimpleNamespace(type=SimpleNamespace(value=self.states.get(flow_run_id, "RUNNING"))))

    def set_flow_run_state(self, flow_run_id: uuid.UUID, state: object, force: bool = False) -> None:
        self.cancelled.append(flow_run_id)


@pytest.fixture
def ctx(tmp_path: Path) -> RunContext:
    cfg = load_config("tiny").with_overrides({"run.restart_backoff_s": 0.0, "run.max_restarts": 2,
                                              "run.heartbeat_timeout_s": 5.0})
    return create_run(open_store(f"file://{tmp_path}/bucket"), "sup-1", cfg, learners=["us-east-0", "eu-west-0"])


@pytest.fixture
def submitted(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    calls: list[dict] = []

    def run_deployment(name: str, **kwargs: object) -> SimpleNamespace:
        if calls and calls[-1].get("refuse"):
            calls.pop()
            raise httpx.ConnectError("server busy")
        calls.append({"name": name, **kwargs})
        return SimpleNamespace(id=uuid.uuid4())

    monkeypatch.setattr("prefect.deployments.run_deployment", run_deployment)
    return calls


def supervisor(ctx: RunContext, client: FakeClient) -> DeploymentSupervisor:
    plan = placement(ctx.learners, {"us-east-0": "learner-us-east", "eu-west-0": "learner-eu-west"})
    sup = DeploymentSupervisor(ctx, make_jobs(ctx, plan, "outer-merge/outer-merge", "evaluate/evaluate"), client)
    sup.start_all()
    for job in sup.jobs.values():
        client.states[job.flow_run_id] = "RUNNING"
    return sup


def test_learners_are_named_and_placed_by_region() -> None:
    assert regional_names(3) == {"us-east-0": "learner/learner-us-east", "eu-west-0": "learner/learner-eu-west",
                                 "us-east-1": "learner/learner-us-east"}
    assert placement(["a", "b"], {"b": "learner-eu-west"}) == {"a": "learner/learner-us-east",
                                                               "b": "learner/learner-eu-west"}
    with pytest.raises(ValueError, match="not in the run"):
        placement(["a"], {"zz": "learner-eu-west"})


def test_every_role_is_submitted_with_tags_and_a_name(ctx: RunContext, submitted: list[dict]) -> None:
    supervisor(ctx, FakeClient())
    by_name = {c["flow_run_name"]: c for c in submitted}
    assert set(by_name) == {"us-east-0", "eu-west-0", "merge-sup-1", "evaluate-sup-1"}
    assert by_name["us-east-0"]["name"] == "learner/learner-us-east"
    assert {"run:sup-1", "region:us-east", "learner:us-east-0"} <= set(by_name["us-east-0"]["tags"])
    assert by_name["eu-west-0"]["parameters"] == {"storage": ctx.store.url, "run_id": "sup-1", "learner": "eu-west-0"}
    assert all(c["timeout"] == 0 for c in submitted)


def test_a_crashed_learner_is_resubmitted_until_the_bound(ctx: RunContext, submitted: list[dict]) -> None:
    client = FakeClient()
    sup = supervisor(ctx, client)
    job = sup.jobs["us-east-0"]
    for attempt in range(1, 4):
        client.states[job.flow_run_id] = "CRASHED"
        sup.heal()  # sees the crash
        sup.heal()  # back-off 0: re-submits (or gives up)
        if attempt <= 2:
            assert job.restarts == attempt and job.flow_run_id is not None
    assert job.removed and job.flow_run_id is None
    sup.events.flush()
    kinds = [e["kind"] for e in read_events(ctx.store, ctx.keys) if e.get("learner") == "us-east-0"]
    assert kinds.count("exit") == 3 and kinds.count("restart") == 2 and kinds[-1] == "give_up"


def test_a_removed_learner_stays_removed(ctx: RunContext, submitted: list[dict]) -> None:
    client = FakeClient()
    sup = supervisor(ctx, client)
    request_remove(ctx, "eu-west-0")
    job = sup.jobs["eu-west-0"]
    client.states[job.flow_run_id] = "COMPLETED"
    before = len(submitted)
    sup.heal()
    sup.heal()
    assert job.removed and len(submitted) == before


def test_a_silent_learner_is_cancelled_and_resubmitted(ctx: RunContext, submitted: list[dict]) -> None:
    client = FakeClient()
    sup = supervisor(ctx, client)
    job = sup.jobs["us-east-0"]
    sup.heal()  # marks it running
    old = job.flow_run_id
    job.running_since = time.time() - 60
    ctx.store.put(ctx.keys.status("us-east-0"), json.dumps({"t": time.time() - 30}).encode())
    sup.heal()
    sup.heal()
    assert client.cancelled == [old] and job.flow_run_id not in (None, old) and job.restarts == 1


def test_a_busy_api_does_not_end_the_supervisor(ctx: RunContext, submitted: list[dict]) -> None:
    client = FakeClient()
    sup = supervisor(ctx, client)
    job = sup.jobs["us-east-0"]
    client.states[job.flow_run_id] = "FAILED"
    submitted.append({"refuse": True})
    sup.heal()  # sees the failure; the API refuses the re-submission: no flow run, no restart counted
    assert job.flow_run_id is None and job.restarts == 0
    job.next_start = 0.0
    sup.heal()
    assert job.flow_run_id is not None and job.restarts == 1


def test_a_restarted_supervisor_adopts_live_flow_runs(ctx: RunContext, submitted: list[dict]) -> None:
    left = uuid.uuid4()
    sup = supervisor(ctx, FakeClient(live={"learner:us-east-0": left}))
    assert sup.jobs["us-east-0"].flow_run_id == left
    assert "us-east-0" not in {c["flow_run_name"] for c in submitted} and len(submitted) == 3

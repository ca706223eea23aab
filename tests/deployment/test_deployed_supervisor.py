"""The deployment backend's plan without a server: learners named and placed by region, and the job of every
role (deployment, parameters, tags, flow-run name). Its decisions are the supervisor core's
(tests/unit/test_supervisor_core.py); against a real Prefect server: tests/deployment/test_deployments.py.

Run: .venv/bin/pytest tests/deployment/test_deployed_supervisor.py   (fast: no server)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.configs import load_config
from diloco.run.context import RunContext
from diloco.run.create import create_run
from diloco.storage import open_store
from diloco.supervise.core import Supervisor
from diloco.supervise.deployments import add_deployment_jobs, placement, regional_names


@pytest.fixture
def ctx(tmp_path: Path) -> RunContext:
    cfg = load_config("tiny")
    return create_run(open_store(f"file://{tmp_path}/bucket"), "sup-1", cfg,
                      learners=["us-east-0", "eu-west-0"])


def test_learners_are_named_and_placed_by_region() -> None:
    assert regional_names(3) == {"us-east-0": "learner/learner-us-east",
                                 "eu-west-0": "learner/learner-eu-west",
                                 "us-east-1": "learner/learner-us-east"}
    assert placement(["a", "b"], {"b": "learner-eu-west"}) == {"a": "learner/learner-us-east",
                                                               "b": "learner/learner-eu-west"}
    with pytest.raises(ValueError, match="not in the run"):
        placement(["a"], {"zz": "learner-eu-west"})


def test_every_role_has_its_deployment_tags_and_a_name(ctx: RunContext) -> None:
    sup = Supervisor(ctx, backend=None)  # only the jobs are built here
    plan = placement(ctx.learners, {"us-east-0": "learner-us-east", "eu-west-0": "learner-eu-west"})
    add_deployment_jobs(sup, plan, "outer-merge/outer-merge", "evaluate/evaluate")
    by_name = {j.spec["flow_run_name"]: j for j in sup.jobs.values()}
    assert set(by_name) == {"us-east-0", "eu-west-0", "merge-sup-1", "evaluate-sup-1"}
    assert by_name["us-east-0"].spec["deployment"] == "learner/learner-us-east"
    assert {"run:sup-1", "region:us-east", "learner:us-east-0"} <= set(by_name["us-east-0"].spec["tags"])
    assert by_name["eu-west-0"].spec["parameters"] == {"storage": ctx.store.url, "run_id": "sup-1",
                                                       "learner": "eu-west-0"}
    assert by_name["merge-sup-1"].role == "merger" and by_name["evaluate-sup-1"].role == "evaluator"

"""A role's flow run in its own process, shown under the `train` flow run that started it (local mode).

Contract: as `run_deployment` does for deployment mode, a task run in the parent flow run stands for the
child (created here, by the child, from the parent's id in DILOCO_PARENT_FLOW_RUN_ID), and the child's flow
run is created with it as parent_task_run_id, so the UI's train flow run lists its learners, merger and
evaluator as subflows; the stand-in task run takes the child's final state. Without the variable (a role
run by hand, a deployment), the flow is called plainly.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

PARENT_ENV = "DILOCO_PARENT_FLOW_RUN_ID"


def call_flow(flow: Any, parameters: dict[str, Any], tags: list[str]) -> Any:
    """Run `flow` with `parameters`: as a subflow of $DILOCO_PARENT_FLOW_RUN_ID when set, else plainly."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return flow(**parameters)
    return run_as_subflow(flow, parameters, uuid.UUID(parent), tags)


def run_as_subflow(flow: Any, parameters: dict[str, Any], parent: uuid.UUID, tags: list[str]) -> Any:
    from prefect import Task
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.states import Completed, Failed, Pending

    stand_in = Task(name=flow.name, fn=lambda: None)
    with get_client(sync_client=True) as client:
        task_run = client.create_task_run(task=stand_in, flow_run_id=parent, dynamic_key=uuid.uuid4().hex[:12],
                                          state=Pending())
        flow_run = client.create_flow_run(flow=flow, parameters=flow.serialize_parameters(parameters),
                                          parent_task_run_id=task_run.id, tags=tags, state=Pending())
    state = run_flow(flow, flow_run=flow_run, parameters=parameters, return_type="state")
    with get_client(sync_client=True) as client:
        client.set_task_run_state(task_run.id, Completed() if state.is_completed() else Failed(), force=True)
    return state.result()

"""A role's flow run in its own process, shown under the `train` flow run that started it (local mode).

Contract: as `run_deployment` does for deployment mode, a task run in the parent flow run stands for the
child (created here, by the child, from the parent's id in DILOCO_PARENT_FLOW_RUN_ID), and the child's flow
run is created with it as parent_task_run_id, so the UI's train flow run lists its learners, merger and
evaluator as subflows; the stand-in task run takes the child's final state. Without the variable (a role
run by hand) the flow run stands alone. Either way its tags are the flow run's, not its task runs'.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

PARENT_ENV = "DILOCO_PARENT_FLOW_RUN_ID"


def call_flow(flow: Any, parameters: dict[str, Any], tags: list[str]) -> Any:
    """Run `flow` with `parameters` in a flow run tagged `tags`: as a subflow of $DILOCO_PARENT_FLOW_RUN_ID
    when set, else on its own. The tags go on the flow run only, never into Prefect's tags context: a tagged
    task run makes Prefect's task engine ask the API for the tags' concurrency slots at every task start, a
    blocking call that took 0.6-1.3 s on average (up to 35 s) a phase on the busy local server of `make
    run`."""
    parent = os.environ.get(PARENT_ENV)
    return run_tagged(flow, parameters, tags, uuid.UUID(parent) if parent else None)


def run_tagged(flow: Any, parameters: dict[str, Any], tags: list[str], parent: uuid.UUID | None) -> Any:
    """Create the flow run (tagged; under a stand-in task run of flow run `parent` when given), run it here,
    give the stand-in its final state; returns the flow's result."""
    from prefect import Task
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.states import Completed, Failed, Pending

    task_run = None
    with get_client(sync_client=True) as client:
        if parent is not None:
            stand_in = Task(name=flow.name, fn=lambda: None)
            task_run = client.create_task_run(task=stand_in, flow_run_id=parent,
                                              dynamic_key=uuid.uuid4().hex[:12], state=Pending())
        flow_run = client.create_flow_run(flow=flow, parameters=flow.serialize_parameters(parameters),
                                          parent_task_run_id=task_run.id if task_run else None, tags=tags,
                                          state=Pending())
    state = run_flow(flow, flow_run=flow_run, parameters=parameters, return_type="state")
    if task_run is not None:
        with get_client(sync_client=True) as client:
            client.set_task_run_state(task_run.id, Completed() if state.is_completed() else Failed(),
                                      force=True)
    return state.result()

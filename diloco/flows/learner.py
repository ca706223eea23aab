"""Flow `learner`: one long-running learner; a task per phase (DESIGN §7).

Contract: the flow ends when the run stops, the target version is committed, or an operator removed
this learner (control/removed-<name>); optional AWS credentials come from a Prefect block.
"""

from __future__ import annotations

from prefect import flow

from diloco.flows.credentials import export_aws_credentials
from diloco.launch import Units, run_role
from diloco.tasks.learner import join_task, phase_task


@flow(name="learner", flow_run_name="{learner}", persist_result=False)
def learner_flow(storage: str, run_id: str, learner: str, phases: int | None = None,
                 aws_credentials_block: str | None = None) -> int:
    """Join the run at its newest version and train until it stops (or for `phases` phases)."""
    if aws_credentials_block:
        export_aws_credentials(aws_credentials_block)
    return run_role("learner", storage, run_id, learner, phases=phases,
                    units=Units(join=join_task, phase=phase_task))

"""Flow `learner`: one long-running learner; a task per phase (DESIGN §7).

Contract: the flow ends when the run stops, the target version is committed, or an operator removed
this learner (control/removed-<name>); optional AWS credentials come from a Prefect block.
"""

from __future__ import annotations

from prefect import flow

from diloco.run.loops import run_learner
from diloco.launch import make_learner
from diloco.supervise.deployments import RemovedSignal, export_aws_credentials
from diloco.tasks.learner import join_task, phase_task


@flow(name="learner", flow_run_name="{learner}", persist_result=False)
def learner_flow(storage: str, run_id: str, learner: str, phases: int | None = None,
                 aws_credentials_block: str | None = None) -> int:
    """Join the run at its newest version and train until it stops (or for `phases` phases)."""
    if aws_credentials_block:
        export_aws_credentials(aws_credentials_block)
    worker, run_stopped = make_learner(storage, run_id, learner)
    removed = RemovedSignal(worker.ctx, learner)
    return run_learner(worker, phases=phases, should_stop=lambda: run_stopped() or removed(),
                       step=phase_task, join=join_task)

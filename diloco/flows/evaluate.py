"""Flow `evaluate`: held-out loss of committed versions, as they appear."""

from __future__ import annotations

from prefect import flow

from diloco.run.loops import run_evaluator
from diloco.launch import make_evaluator
from diloco.supervise.deployments import export_aws_credentials
from diloco.tasks.evaluate import evaluate_task


@flow(name="evaluate", flow_run_name="evaluate-{run_id}", persist_result=False)
def evaluate_flow(storage: str, run_id: str, aws_credentials_block: str | None = None) -> int:
    """Score each committed version (on the eval cadence, plus the first and the last)."""
    if aws_credentials_block:
        export_aws_credentials(aws_credentials_block)
    evaluator, should_stop = make_evaluator(storage, run_id)
    return run_evaluator(evaluator, should_stop=should_stop, evaluate=evaluate_task)

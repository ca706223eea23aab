"""Flow `evaluate`: held-out loss of committed versions, as they appear."""

from __future__ import annotations

from prefect import flow

from diloco.flows.credentials import export_aws_credentials
from diloco.launch import Units, run_role
from diloco.tasks.evaluate import evaluate_task


@flow(name="evaluate", flow_run_name="evaluate-{run_id}", persist_result=False)
def evaluate_flow(storage: str, run_id: str, aws_credentials_block: str | None = None) -> int:
    """Score each committed version (on the eval cadence, plus the first and the last)."""
    if aws_credentials_block:
        export_aws_credentials(aws_credentials_block)
    return run_role("evaluator", storage, run_id, units=Units(evaluate=evaluate_task))

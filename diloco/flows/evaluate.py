"""Flow `evaluate`: held-out loss of committed versions, as they appear."""

from __future__ import annotations

from prefect import flow

from diloco.engine.loops import run_evaluator
from diloco.engine.roles import make_evaluator
from diloco.tasks.evaluate import evaluate_task


@flow(name="evaluate", flow_run_name="evaluate-{run_id}", persist_result=False)
def evaluate_flow(storage: str, run_id: str) -> int:
    evaluator, should_stop = make_evaluator(storage, run_id)
    return run_evaluator(evaluator, should_stop=should_stop, evaluate_due=evaluate_task)

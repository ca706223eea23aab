"""Flow `learner`: one long-running learner; a task per phase (DESIGN §7)."""

from __future__ import annotations

from prefect import flow

from diloco.engine.loops import run_learner
from diloco.engine.roles import make_learner
from diloco.tasks.learner import join_task, phase_task


@flow(name="learner", flow_run_name="{learner}", persist_result=False)
def learner_flow(storage: str, run_id: str, learner: str, phases: int | None = None) -> int:
    """Join the run at its newest version and train until it stops (or for `phases` phases)."""
    worker, should_stop = make_learner(storage, run_id, learner)
    return run_learner(worker, phases=phases, should_stop=should_stop, step=phase_task, join=join_task)

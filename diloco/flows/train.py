"""Flow `train`: the supervisor — start merger, evaluator and learners, heal, stop at the target."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from diloco.engine.run import open_run
from diloco.engine.supervisor import Supervisor
from diloco.tasks.common import artifact_key


@flow(name="train", flow_run_name="train-{run_id}", persist_result=False)
def train_flow(storage: str, run_id: str, log_dir: str | None = None, chaos_plan: str | None = None) -> dict:
    """Run every role of an existing run as local processes reporting to this Prefect API."""
    logger = get_run_logger()
    ctx = open_run(storage, run_id)
    supervisor = Supervisor(ctx, prefect=True, log_dir=log_dir)
    if chaos_plan:
        from diloco.chaos.agent import attach_chaos

        attach_chaos(supervisor, chaos_plan)
    target = ctx.cfg.run.num_versions
    progress_id = create_progress_artifact(0.0, key=artifact_key("progress", run_id),
                                           description=f"run {run_id}: versions committed of {target}")
    seen = {"version": 0}

    def report(sup: Supervisor) -> None:
        version = sup.latest()
        if version > seen["version"]:
            seen["version"] = version
            update_progress_artifact(progress_id, min(100.0, 100.0 * version / target))
            logger.info("run %s: version %d of %d", run_id, version, target)

    supervisor.start_all()
    reason = "error"
    try:
        reason = supervisor.run(on_tick=report)
    finally:
        supervisor.shutdown(reason)
    return {"run_id": run_id, "reason": reason, "version": supervisor.latest()}

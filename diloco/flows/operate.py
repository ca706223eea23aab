"""Flow `operate`: the operator's controls as a flow run the Prefect UI can trigger (deployment `operate` on
the control pool) — admit, remove, readmit, pause/resume merges, set, stop, resume, fork.

Contract: the same functions as the CLI and Python (diloco.supervise.operate), recorded as made by this flow
run (`prefect flow run <name> (<id>)`); a bad input fails the flow run with the one-line reason and writes
nothing; `resume` and `fork` can start the `train` deployment for the run (start=True) without waiting for it.
"""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from diloco.flows.credentials import export_aws_credentials
from diloco.tasks.common import artifact_key

Action = Literal["admit-learner", "remove-learner", "readmit", "pause-merges", "resume-merges", "set", "stop",
                 "resume", "fork"]
TRAIN_DEPLOYMENT = "train/train"


def _by() -> str:
    from prefect.runtime import flow_run

    return f"prefect flow run {flow_run.name} ({flow_run.id})" if flow_run.id else "prefect"


def _start_training(storage: str, run_id: str, deployment: str, aws_credentials_block: str | None) -> str:
    from prefect.deployments import run_deployment

    parameters: dict[str, Any] = {"storage": storage, "run_id": run_id, "mode": "deployments", "config": None}
    if aws_credentials_block:
        parameters["aws_credentials_block"] = aws_credentials_block
    run = run_deployment(deployment, parameters=parameters, timeout=0, tags=[f"run:{run_id}", "role:train"],
                         flow_run_name=f"train-{run_id}")
    return str(run.id)


def _do(action: str, storage: str, run_id: str, by: str, *, learner: str | None,
        settings: dict[str, Any] | None,
        versions: int | None, time_limit_s: float | None, at_version: int | None, new_run_id: str | None,
        reason: str, force: bool = False) -> dict[str, Any]:
    from diloco.supervise import operate

    if action in ("admit-learner", "remove-learner", "readmit") and not learner:
        raise ValueError(f"action {action} needs `learner`")
    if action == "admit-learner":
        return {"op": operate.admit_learner(storage, run_id, learner, reason=reason, by=by)}
    if action == "remove-learner":
        operate.remove_learner(storage, run_id, learner, reason=reason or "operator", by=by)
        return {}
    if action == "readmit":
        return {"op": operate.readmit(storage, run_id, learner, reason=reason, by=by)}
    if action == "pause-merges":
        return {"op": operate.pause_merges(storage, run_id, reason=reason, by=by)}
    if action == "resume-merges":
        return {"op": operate.resume_merges(storage, run_id, reason=reason, by=by)}
    if action == "set":
        return {"op": operate.set_settings(storage, run_id, settings or {}, reason=reason, by=by,
                                           force=force)}
    if action == "stop":
        from diloco.run.context import open_run
        from diloco.run.signals import request_stop

        request_stop(open_run(storage, run_id), reason or by)
        return {}
    if action == "resume":
        return operate.prepare_resume(storage, run_id, versions=versions, time_limit_s=time_limit_s, by=by)
    if action == "fork":
        if at_version is None or not new_run_id:
            raise ValueError("action fork needs `at_version` and `new_run_id`")
        from diloco.inspect.fork import fork

        return {"run_id": fork(storage, run_id, at_version, new_run_id, by=by).run_id}
    raise ValueError(f"action {action!r} is unknown")


@flow(name="operate", flow_run_name="{action}-{run_id}", persist_result=False)
def operate_flow(storage: str, run_id: str, action: Action, learner: str | None = None,
                 settings: dict[str, Any] | None = None, versions: int | None = None,
                 time_limit_s: float | None = None, at_version: int | None = None,
                 new_run_id: str | None = None, reason: str = "", start: bool = False, force: bool = False,
                 train_deployment: str = TRAIN_DEPLOYMENT,
                 aws_credentials_block: str | None = None) -> dict[str, Any]:
    """One control on one run. settings: {"merger.quorum": 3, ...} for `set`; versions (more to train) and
    time_limit_s for `resume`; at_version and new_run_id for `fork`; start: run `train_deployment` after
    resume or fork; force: `set` a value that would reject the deltas the run sends now."""
    if aws_credentials_block:
        export_aws_credentials(aws_credentials_block)
    by = _by()
    result = _do(action, storage, run_id, by, learner=learner, settings=settings, versions=versions,
                 time_limit_s=time_limit_s, at_version=at_version, new_run_id=new_run_id, reason=reason,
                 force=force)
    if start and action in ("resume", "fork"):
        target = result.get("run_id", run_id) if action == "fork" else run_id
        result["train_flow_run"] = _start_training(storage, target, train_deployment, aws_credentials_block)
    get_run_logger().info("run %s: %s %s by %s -> %s", run_id, action, learner or "", by, result)
    create_markdown_artifact(
        f"**{action}** on run `{run_id}` by {by}\n\n" + "\n".join(f"- {k}: `{v}`" for k, v in result.items()),
        key=artifact_key("operate", run_id), description=f"run {run_id}: {action}")
    return {"action": action, "run_id": run_id, "by": by, **result}

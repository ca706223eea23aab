"""Flow `train`: the supervisor — start merger, evaluator and learners, heal, stop at the target.

Contract: mode "local" runs every role as a process of this machine; mode "deployments" starts them as
runs of their deployments (a learner per region, see prefect.yaml), creating the run first if needed. The
supervisor's warnings go to this flow run's own logs; a role that cannot be started (a deployment that does
not exist) fails the flow with the reason, after bounded retries; the flow ends with the run's summary as a
markdown artifact (evaluating version 0 and the final version if the evaluator did not reach them), and fails
(RunFailed: the reason, each failed learner's error line and log in its logs) when the run failed
(diloco.inspect.outcome).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal

import httpx
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.exceptions import PrefectException

from diloco.flows.credentials import export_aws_credentials
from diloco.inspect.outcome import RunFailed
from diloco.run.context import RunContext, open_run
from diloco.run.create import create_run
from diloco.storage import StorageError
from diloco.supervise.core import LEARNERS_CRASHED, RoleUnstartable
from diloco.supervise.deployments import (
    EVALUATOR_DEPLOYMENT,
    MERGER_DEPLOYMENT,
    deployment_supervisor,
    placement,
    regional_names,
)
from diloco.tasks.common import artifact_key


@flow(name="train", flow_run_name="train-{run_id}", persist_result=False)
def train_flow(
    storage: str,
    run_id: str,
    mode: Literal["local", "deployments"] = "local",
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    learners: dict[str, str] | None = None,
    merger_deployment: str = MERGER_DEPLOYMENT,
    evaluator_deployment: str = EVALUATOR_DEPLOYMENT,
    aws_credentials_block: str | None = None,
    log_dir: str | None = None,
    chaos_plan: str | None = None,
) -> dict:
    """Supervise a run until its target version (or a stop request, or its time limit).

    storage, run_id: where the run lives. config (recipe name or YAML path) and overrides (dotted keys,
    e.g. {"run.num_versions": 20}) create the run when it does not exist yet. learners maps a learner to
    its regional deployment (`learner-us-east`); by default learners are spread over the regions.
    """
    if aws_credentials_block:
        export_aws_credentials(aws_credentials_block)
    if mode not in ("local", "deployments"):
        raise ValueError(f"mode {mode!r} is invalid: must be 'local' or 'deployments'")
    with _diloco_logs_to_flow_run():
        plan: dict[str, str] = {}
        if mode == "deployments":
            ctx, plan = _deployment_run(storage, run_id, config, overrides, learners)
        else:
            ctx = _local_run(storage, run_id, config, overrides)
        try:
            if mode == "deployments":
                result = _supervise_deployments(ctx, plan, merger_deployment, evaluator_deployment,
                                                aws_credentials_block)
            else:
                result = _supervise_local(ctx, log_dir, chaos_plan)
        except RoleUnstartable as err:
            get_run_logger().error("run %s cannot go on: %s", run_id, err)
            raise
        summary = _report_summary(ctx)
    failure = (summary["failure"] if summary
               else (LEARNERS_CRASHED if result["reason"] == LEARNERS_CRASHED else None))
    # the flow run ends Failed, with the reason (each failed learner's error and log), after the summary
    if failure:
        from diloco.inspect.report import summary_json

        raise RunFailed(f"run {run_id} failed: {failure}", summary_json(summary) if summary else {})
    return result


@contextlib.contextmanager
def _diloco_logs_to_flow_run() -> Iterator[None]:
    """The engine's warnings and errors (logger `diloco.*`: a refused start, a lost lease) in this flow run's
    logs, not only in the process's stderr."""
    from prefect.logging.handlers import APILogHandler
    from prefect.runtime import flow_run

    run_id = flow_run.id
    handler = APILogHandler(level=logging.WARNING)
    handler.addFilter(lambda record: setattr(record, "flow_run_id", run_id) or True)
    logger = logging.getLogger("diloco")
    if run_id:
        logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _report_summary(ctx: RunContext) -> dict | None:
    """Evaluate what the evaluator missed, then the summary as a markdown artifact and one log line (and one
    per failed learner); the summary, or None when it could not be built."""
    from diloco.evaluator.evaluator import evaluate_missing
    from diloco.inspect.outcome import failure_lines
    from diloco.inspect.summary import build_summary, summary_markdown

    logger = get_run_logger()
    try:
        done = evaluate_missing(ctx)
        if done:
            logger.info("run %s: evaluated version %s at the end", ctx.run_id, " and ".join(map(str, done)))
        summary = build_summary(ctx)
    except StorageError as err:  # the run is done: only the summary is lost
        logger.warning("summary not built: %s", err)
        return None
    try:
        create_markdown_artifact(summary_markdown(summary), key=artifact_key("summary", ctx.run_id),
                                 description=f"run {ctx.run_id}: {summary['state_title']}")
    except (httpx.HTTPError, PrefectException) as err:
        logger.warning("summary artifact not written: %s", err)
    logger.info("run %s %s; held-out loss %s -> %s %s", ctx.run_id, summary["state_title"],
                _loss(summary["initial_eval_loss"]), _loss(summary["final_eval_loss"]), summary["metric"])
    for line in failure_lines(summary["failed_learners"]):
        logger.error("run %s: %s", ctx.run_id, line)
    return summary


def _loss(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _local_run(storage: str, run_id: str, config: str | None, overrides: dict[str, Any] | None) -> RunContext:
    if config is None:
        return open_run(storage, run_id)
    from diloco.configs import load_config
    from diloco.storage import open_store

    return create_run(open_store(storage), run_id, load_config(config).with_overrides(overrides or {}))


def _deployment_run(storage: str, run_id: str, config: str | None, overrides: dict[str, Any] | None,
                    learners: dict[str, str] | None) -> tuple[RunContext, dict[str, str]]:
    """Open the run, or create it with learners named after their regions; place every learner."""
    from diloco.run.context import RunError

    try:
        ctx = open_run(storage, run_id)
    except RunError:
        if config is None:
            raise RunError(f"no run {run_id!r} in {storage}: pass `config` (a recipe) to create it") from None
        from diloco.configs import load_config
        from diloco.configs.effects import knob_warnings
        from diloco.storage import open_store

        cfg = load_config(config).with_overrides(overrides or {})
        for line in knob_warnings(config, overrides, cfg, "deployments"):
            get_run_logger().warning(line)
        names = list(learners) if learners else list(regional_names(cfg.run.num_learners))
        ctx = create_run(open_store(storage), run_id, cfg, learners=names)
    return ctx, placement(ctx.learners, learners or regional_names(len(ctx.learners)))


def _progress(ctx: RunContext) -> Callable[[Any], None]:
    """A progress artifact (versions committed of the target, or tokens merged of the token budget) and a
    reporter that updates it."""
    from diloco.run.target import run_target, run_tokens

    logger = get_run_logger()
    target = run_target(ctx)
    progress_id = create_progress_artifact(0.0, key=artifact_key("progress", ctx.run_id),
                                           description=f"run {ctx.run_id}: progress to {target.describe()}")
    seen = {"version": 0}

    def report(sup: Any) -> None:
        version = sup.latest()
        if version > seen["version"]:
            share = version / target.versions
            try:
                if target.tokens > 0:
                    share = max(share, run_tokens(ctx) / target.tokens)
                update_progress_artifact(progress_id, min(100.0, 100.0 * share))
            # a busy API must not end the run
            except (httpx.HTTPError, PrefectException, StorageError) as err:
                logger.warning("progress artifact not updated: %s", err)
                return
            seen["version"] = version
            logger.info("run %s: version %d, %.0f%% of %s", ctx.run_id, version, 100.0 * share,
                        target.describe())

    return report


def _supervise_local(ctx: RunContext, log_dir: str | None, chaos_plan: str | None) -> dict:
    from prefect.runtime import flow_run

    from diloco.flows.subflow import PARENT_ENV
    from diloco.launch import chaos_agent
    from diloco.supervise.local import supervise_local

    env = {PARENT_ENV: str(flow_run.id)} if flow_run.id else {}  # the roles' flow runs show under this one
    reason = supervise_local(ctx, prefect=True, log_dir=log_dir, attach=chaos_agent(chaos_plan),
                             on_tick=_progress(ctx), env=env)
    return {"run_id": ctx.run_id, "reason": reason, "version": _latest(ctx)}


def _latest(ctx: RunContext) -> int:
    from diloco.run.fragments import run_version

    return run_version(ctx) or 0


def _tag_self(client: Any, run_id: str) -> None:
    """Make the supervisor's own flow run easy to find: tag it with the run id."""
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    try:
        client.update_flow_run(flow_run.id, tags=sorted({*flow_run.tags, f"run:{run_id}", "role:train"}))
    except (httpx.HTTPError, PrefectException) as err:
        get_run_logger().warning("could not tag the train flow run: %s", err)


def _supervise_deployments(ctx: RunContext, plan: dict[str, str], merger_deployment: str,
                           evaluator_deployment: str, aws_credentials_block: str | None) -> dict:
    from prefect.client.orchestration import get_client

    logger = get_run_logger()
    with get_client(sync_client=True) as client:
        _tag_self(client, ctx.run_id)
        supervisor = deployment_supervisor(ctx, client, plan, merger_deployment=merger_deployment,
                                           evaluator_deployment=evaluator_deployment,
                                           aws_credentials_block=aws_credentials_block)
        logger.info("run %s: learners %s", ctx.run_id, ", ".join(f"{k} -> {v}" for k, v in plan.items()))
        reason = supervisor.run_to_end(shutdown_grace_s=120.0, tick_s=1.0, on_tick=_progress(ctx))
        restarts = {j.name: j.restarts for j in supervisor.jobs.values() if j.restarts}
        return {"run_id": ctx.run_id, "reason": reason, "version": supervisor.latest(), "restarts": restarts}

"""Deployment mode of `train`: each learner is a flow run of its region's deployment, healed via Prefect.

Contract: roles start as non-blocking runs of their deployments; a learner whose flow run ended before
the run did, or whose heartbeat stopped, is re-submitted with back-off at most run.max_restarts times;
a learner an operator removed (control/removed-<name>) stays removed; credentials never enter a log.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import typer

from diloco.run.events import EventLog
from diloco.run.loops import RemovedSignal, StopSignal, request_remove, request_stop  # the first two moved there
from diloco.run.context import RunContext
from diloco.storage import NotFound, StorageError, latest_version

if TYPE_CHECKING:
    from uuid import UUID

    from prefect.client.orchestration import SyncPrefectClient

log = logging.getLogger("diloco.deployed")

LEARNER_DEPLOYMENTS = ("learner/learner-us-east", "learner/learner-eu-west")  # prefect.yaml's regions
MERGER_DEPLOYMENT = "outer-merge/outer-merge"
EVALUATOR_DEPLOYMENT = "evaluate/evaluate"
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})


def remove_learner(
    storage: str = typer.Option(..., "--storage", help="Where the run lives."),
    run_id: str = typer.Option(..., "--run-id", help="The run's id."),
    learner: str = typer.Option(..., "--learner", help="The learner to remove for good."),
    reason: str = typer.Option("operator", "--reason"),
) -> None:
    """Remove a learner from a run: it ends after its phase and the supervisor does not restart it."""
    from diloco.cli import user_errors
    from diloco.run.context import open_run

    with user_errors():
        request_remove(open_run(storage, run_id), learner, reason)
        typer.echo(f"learner {learner} removed from run {run_id}")


# ---- credentials --------------------------------------------------------------------------------
def export_aws_credentials(block_name: str) -> None:
    """Load a prefect-aws AwsCredentials block into the standard AWS variables of this process only."""
    try:
        from prefect_aws import AwsCredentials
    except ImportError:
        raise ValueError("aws_credentials_block needs prefect-aws: pip install 'diloco[aws]'") from None
    creds = AwsCredentials.load(block_name)
    secret = creds.aws_secret_access_key.get_secret_value() if creds.aws_secret_access_key else None
    values = {
        "AWS_ACCESS_KEY_ID": creds.aws_access_key_id, "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_SESSION_TOKEN": creds.aws_session_token, "AWS_PROFILE": creds.profile_name,
        "AWS_DEFAULT_REGION": creds.region_name, "AWS_ENDPOINT_URL": creds.aws_client_parameters.endpoint_url,
    }
    for name, value in values.items():
        if value:
            os.environ[name] = str(value)
    log.info("AWS credentials from block %r exported (%s)", block_name,
             ", ".join(n for n, v in values.items() if v))


# ---- which learner runs where --------------------------------------------------------------------
def full_deployment_name(name: str) -> str:
    """`learner-us-east` -> `learner/learner-us-east`; a full `<flow>/<deployment>` stays as it is."""
    return name if "/" in name else f"learner/{name}"


def region_of(deployment: str) -> str:
    """`learner/learner-us-east` -> `us-east`."""
    return deployment.split("/")[-1].removeprefix("learner-")


def regional_names(num_learners: int, deployments: tuple[str, ...] = LEARNER_DEPLOYMENTS) -> dict[str, str]:
    """Learners named after their region, round-robin over the regional deployments: us-east-0, eu-west-0, …"""
    plan: dict[str, str] = {}
    counts: dict[str, int] = {}
    for i in range(num_learners):
        deployment = deployments[i % len(deployments)]
        region = region_of(deployment)
        plan[f"{region}-{counts.get(region, 0)}"] = deployment
        counts[region] = counts.get(region, 0) + 1
    return plan


def placement(run_learners: list[str], requested: dict[str, str] | None) -> dict[str, str]:
    """learner -> deployment for every learner of the run; unplaced learners go round-robin."""
    requested = {k: full_deployment_name(v) for k, v in (requested or {}).items()}
    unknown = sorted(set(requested) - set(run_learners))
    if unknown:
        raise ValueError(f"learners {unknown} are not in the run (its learners: {run_learners})")
    return {name: requested.get(name, LEARNER_DEPLOYMENTS[i % len(LEARNER_DEPLOYMENTS)])
            for i, name in enumerate(run_learners)}


@dataclass
class Job:
    """One role of the run as a sequence of flow runs of one deployment."""

    role: str  # "learner" | "merger" | "evaluator"
    name: str
    deployment: str
    parameters: dict[str, Any]
    tags: list[str]
    flow_run_name: str | None = None  # named at creation, so the UI shows it before the flow starts
    flow_run_id: UUID | None = None
    running_since: float | None = None
    restarts: int = 0
    next_start: float = 0.0
    removed: bool = False
    flow_runs: list[str] = field(default_factory=list)


def make_jobs(ctx: RunContext, learners: dict[str, str], merger_deployment: str, evaluator_deployment: str,
              aws_credentials_block: str | None = None) -> list[Job]:
    base: dict = {"storage": ctx.store.url, "run_id": ctx.run_id}
    if aws_credentials_block:
        base["aws_credentials_block"] = aws_credentials_block
    run_tag = f"run:{ctx.run_id}"
    jobs = [Job("evaluator", "evaluator", evaluator_deployment, dict(base), [run_tag, "role:evaluate"],
                f"evaluate-{ctx.run_id}"),
            Job("merger", "merger", merger_deployment, dict(base), [run_tag, "role:merger"], f"merge-{ctx.run_id}")]
    for name, deployment in learners.items():
        params = {**base, "learner": name}
        jobs.append(Job("learner", name, deployment, params,
                        [run_tag, "role:learner", f"learner:{name}", f"region:{region_of(deployment)}"], name))
    return jobs


class DeploymentSupervisor:
    """Submit every job as a run of its deployment, watch states and heartbeats, re-submit, stop."""

    def __init__(self, ctx: RunContext, jobs: list[Job], client: SyncPrefectClient,
                 events: EventLog | None = None, tick_s: float = 1.0) -> None:
        self.ctx, self.cfg, self.client, self.tick_s = ctx, ctx.cfg, client, tick_s
        self.jobs = {job.name: job for job in jobs}
        self.events = events or EventLog(ctx.store, ctx.keys, "supervisor")
        self.removed = {j.name: RemovedSignal(ctx, j.name) for j in jobs if j.role == "learner"}
        self.stop_signal = StopSignal(ctx)
        self.started_at = time.time()

    # ---- flow runs -----------------------------------------------------------------------
    def submit(self, job: Job) -> bool:
        """Create a flow run of the job's deployment (non-blocking); False when the API refused."""
        import httpx
        from prefect.deployments import run_deployment
        from prefect.exceptions import PrefectException

        try:
            flow_run = run_deployment(job.deployment, parameters=job.parameters, timeout=0, tags=job.tags,
                                      flow_run_name=job.flow_run_name)
        except (httpx.HTTPError, PrefectException) as err:
            log.warning("run %s: could not submit %s to %s (%s); retrying", self.ctx.run_id, job.name,
                        job.deployment, err)
            self.events.emit("submit_failed", role=job.role, learner=job.name, reason=str(err)[:200])
            job.flow_run_id, job.next_start = None, time.time() + self.cfg.run.restart_backoff_s * 4
            return False
        job.flow_run_id, job.running_since = flow_run.id, None
        job.flow_runs.append(str(flow_run.id))
        self.events.emit("start", role=job.role, learner=job.name, deployment=job.deployment,
                         flow_run_id=str(flow_run.id), restarts=job.restarts)
        log.info("run %s: %s %s submitted to %s as flow run %s", self.ctx.run_id, job.role, job.name,
                 job.deployment, flow_run.id)
        return True

    def state_of(self, job: Job) -> str | None:
        """The flow run's state type (RUNNING, CRASHED, …), or None when the API did not answer."""
        import httpx
        from prefect.exceptions import PrefectException

        try:
            state = self.client.read_flow_run(job.flow_run_id).state
        except (httpx.HTTPError, PrefectException) as err:
            log.warning("state of %s unknown: %s", job.name, err)
            return None
        return state.type.value if state else None

    def cancel(self, job: Job, reason: str) -> None:
        """Ask the job's worker to kill its flow run (Cancelling); the job counts as down from now."""
        import httpx
        from prefect.exceptions import PrefectException
        from prefect.states import Cancelling

        try:
            self.client.set_flow_run_state(job.flow_run_id, Cancelling(message=reason), force=True)
        except (httpx.HTTPError, PrefectException) as err:
            log.warning("could not cancel %s: %s", job.name, err)
        self.events.emit("kill", role=job.role, learner=job.name, flow_run_id=str(job.flow_run_id), reason=reason)

    def adopt(self, job: Job) -> bool:
        """Take over a live flow run of this job left by an earlier train run of the same run id (a
        restarted supervisor), rather than start a second process under the same learner name."""
        import httpx
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterState,
            FlowRunFilterStateType,
            FlowRunFilterTags,
        )
        from prefect.client.schemas.objects import StateType
        from prefect.client.schemas.sorting import FlowRunSort
        from prefect.exceptions import PrefectException

        tags = [t for t in job.tags if t.startswith(("run:", "role:", "learner:"))]
        live = FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING])
        try:
            runs = self.client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=tags), state=FlowRunFilterState(type=live)),
                sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1)
        except (httpx.HTTPError, PrefectException) as err:
            log.warning("could not look for a live flow run of %s: %s", job.name, err)
            return False
        if not runs:
            return False
        job.flow_run_id = runs[0].id
        job.flow_runs.append(str(runs[0].id))
        self.events.emit("adopt", role=job.role, learner=job.name, flow_run_id=str(runs[0].id))
        return True

    def start_all(self) -> None:
        for job in self.jobs.values():
            if not self.adopt(job):
                self.submit(job)

    # ---- the watch loop ------------------------------------------------------------------
    def heal(self) -> None:
        """Re-submit flow runs that ended or went silent while the run goes on."""
        now = time.time()
        for job in self.jobs.values():
            if job.removed:
                continue
            if job.role == "learner" and self.removed[job.name]():
                job.removed = True
                self.events.emit("removed", role=job.role, learner=job.name)
                log.info("learner %s was removed by an operator; not restarting it", job.name)
                continue
            if job.flow_run_id is not None:
                self._check(job, now)
            if job.flow_run_id is None and now >= job.next_start:
                self._restart(job)

    def _check(self, job: Job, now: float) -> None:
        state = self.state_of(job)
        if state == "RUNNING" and job.running_since is None:
            job.running_since = now
        if state in FINAL_STATES:
            self.events.emit("exit", role=job.role, learner=job.name, state=state, flow_run_id=str(job.flow_run_id))
            log.warning("%s %s: flow run %s ended %s", job.role, job.name, job.flow_run_id, state)
        elif state == "RUNNING" and job.role == "learner" and self._silent(job, now):
            self.cancel(job, "heartbeat stopped")
        else:
            return
        job.flow_run_id = None
        job.next_start = now + self.cfg.run.restart_backoff_s * (2 ** min(job.restarts, 5))

    def _restart(self, job: Job) -> None:
        if job.restarts >= self.cfg.run.max_restarts:
            log.error("%s exceeded max_restarts=%d; leaving it down", job.name, self.cfg.run.max_restarts)
            self.events.emit("give_up", role=job.role, learner=job.name)
            job.removed = True
            return
        job.restarts += 1
        if self.submit(job):
            self.events.emit("restart", role=job.role, learner=job.name, restarts=job.restarts)
        else:
            job.restarts -= 1  # the API refused; that attempt never ran

    def _silent(self, job: Job, now: float) -> bool:
        """No heartbeat newer than heartbeat_timeout_s, counting from when this flow run started."""
        timeout = self.cfg.run.heartbeat_timeout_s
        if job.running_since is None or now - job.running_since < timeout:
            return False
        try:
            beat = float(json.loads(self.ctx.store.get(self.ctx.keys.status(job.name))).get("t", 0))
        except NotFound:
            beat = 0.0
        except (StorageError, ValueError):
            return False  # the bucket is the trouble, not the learner
        return now - max(beat, job.running_since) > timeout

    def latest(self) -> int:
        try:
            return latest_version(self.ctx.store, self.ctx.keys) or 0
        except StorageError:
            return -1

    def run_to_end(self, on_tick: Callable[[DeploymentSupervisor], None] | None = None) -> str:
        """start_all, run, and always shut down; returns why it ended."""
        self.start_all()
        reason = "error"
        try:
            reason = self.run(on_tick=on_tick)
        finally:
            self.shutdown(reason)
        return reason

    def run(self, on_tick: Callable[[DeploymentSupervisor], None] | None = None) -> str:
        """Watch until the target version, a stop request or the time limit; returns why it ended."""
        target, limit = self.cfg.run.num_versions, self.cfg.run.time_limit_s
        reason = "time limit"
        while time.time() - self.started_at < limit:
            if self.latest() >= target:
                reason = "target version"
                break
            if self.stop_signal():
                reason = "stop requested"
                break
            self.heal()
            if on_tick:
                on_tick(self)
            self.events.flush()
            time.sleep(self.tick_s)
        self.events.emit("end", reason=reason, version=self.latest())
        return reason

    def shutdown(self, reason: str, grace_s: float = 120.0) -> None:
        """Ask everyone to stop, wait for their flow runs to end (final evaluation), cancel the rest."""
        try:
            if not self.ctx.store.exists(self.ctx.keys.stop()):
                request_stop(self.ctx, reason)
        except StorageError as err:
            log.warning("could not write control/stop: %s", err)
        deadline = time.time() + grace_s
        live = [j for j in self.jobs.values() if j.flow_run_id is not None]
        while live and time.time() < deadline:
            live = [j for j in live if self.state_of(j) not in FINAL_STATES]
            time.sleep(self.tick_s)
        for job in live:
            self.cancel(job, "did not stop in time")
        self.events.emit("shutdown", reason=reason)
        self.events.flush()

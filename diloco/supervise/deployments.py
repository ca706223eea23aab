"""The Prefect backend of the supervisor: every role of a run as flow runs of its deployment.

Contract: a role starts as a non-blocking run of its deployment (a learner on its region's pool, see
prefect.yaml), named and tagged so the UI shows it at once; a live flow run left by an earlier supervisor of
the same run is adopted rather than doubled; a refused submission is retried (supervise/core.py bounds it);
a flow run's state is read from the API each tick; killing one cancels it (its worker ends the process).
Watch loop, restart policy, silence and removal are the core's, the same as for local processes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from diloco.run.context import RunContext
from diloco.run.events import EventLog
from diloco.run.fragments import merger_ids
from diloco.supervise.core import ENDED, RUNNING, STARTING, UNKNOWN, Job, Supervisor

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

log = logging.getLogger("diloco.deployed")

LEARNER_DEPLOYMENTS = ("learner/learner-us-east", "learner/learner-eu-west")  # prefect.yaml's regions
MERGER_DEPLOYMENT = "outer-merge/outer-merge"
EVALUATOR_DEPLOYMENT = "evaluate/evaluate"
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})
STARTING_STATES = frozenset({"SCHEDULED", "PENDING", "CANCELLING", "PAUSED"})


# ---- which learner runs where --------------------------------------------------------------------
def full_deployment_name(name: str) -> str:
    """`learner-us-east` -> `learner/learner-us-east`; a full `<flow>/<deployment>` stays as it is."""
    return name if "/" in name else f"learner/{name}"


def region_of(deployment: str) -> str:
    """`learner/learner-us-east` -> `us-east`."""
    return deployment.split("/")[-1].removeprefix("learner-")


def regional_names(num_learners: int, deployments: tuple[str, ...] = LEARNER_DEPLOYMENTS) -> dict[str, str]:
    """Learners named after their region, round-robin over the regional deployments: us-east-0, eu-west-0,
    …"""
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


def add_deployment_jobs(sup: Supervisor, learners: dict[str, str], merger_deployment: str = MERGER_DEPLOYMENT,
                        evaluator_deployment: str = EVALUATOR_DEPLOYMENT,
                        aws_credentials_block: str | None = None) -> None:
    """One job per role, each with its deployment, parameters, tags and flow-run name."""
    ctx = sup.ctx
    base: dict = {"storage": ctx.store.url, "run_id": ctx.run_id}
    if aws_credentials_block:
        base["aws_credentials_block"] = aws_credentials_block
    run_tag = f"run:{ctx.run_id}"
    sup.add("evaluator", "evaluator", deployment=evaluator_deployment, parameters=dict(base),
            tags=[run_tag, "role:evaluate"], flow_run_name=f"evaluate-{ctx.run_id}")
    for shard, merger_id in enumerate(merger_ids(ctx)):  # fragments: merger, merger-s1, ...
        sup.add("merger", merger_id, deployment=merger_deployment,
                parameters=dict(base) if shard == 0 else {**base, "merger_id": merger_id},
                tags=[run_tag, "role:merger"] + ([f"shard:{shard}"] if ctx.fragments else []),
                flow_run_name=f"merge-{ctx.run_id}" if shard == 0 else f"merge-{ctx.run_id}-s{shard}")
    for name, deployment in learners.items():
        sup.add("learner", name, **learner_job_spec(base, run_tag, name, deployment))
    # a learner admitted later goes round-robin over the regions
    sup.learner_spec = lambda name: learner_job_spec(
        base, run_tag, name,
        LEARNER_DEPLOYMENTS[sum(j.role == "learner" for j in sup.jobs.values()) % len(LEARNER_DEPLOYMENTS)])


def learner_job_spec(base: dict, run_tag: str, name: str, deployment: str) -> dict:
    """A learner job's deployment, parameters, tags and flow-run name."""
    return {"deployment": deployment, "parameters": {**base, "learner": name},
            "tags": [run_tag, "role:learner", f"learner:{name}", f"region:{region_of(deployment)}"],
            "flow_run_name": name}


class DeploymentBackend:
    """Roles as flow runs of their deployments, through a Prefect API client."""

    defer_evaluator = False  # it runs on the control pool, not beside the learners
    kind = "deployments"  # recorded in the run's lease

    def __init__(self, ctx: RunContext, client: SyncPrefectClient, events: EventLog) -> None:
        self.ctx, self.client, self.events = ctx, client, events

    def _api_errors(self) -> tuple[type[BaseException], ...]:
        import httpx
        from prefect.exceptions import PrefectException

        return httpx.HTTPError, PrefectException

    def start(self, job: Job, asked: float) -> str | None:
        """Adopt a live flow run of this job (a restarted supervisor), else submit one (non-blocking)."""
        from prefect.deployments import run_deployment

        if not job.history and self._adopt(job):
            return None
        try:
            flow_run = run_deployment(job.spec["deployment"], parameters=job.spec["parameters"], timeout=0,
                                      tags=job.spec["tags"], flow_run_name=job.spec["flow_run_name"])
        except self._api_errors() as err:
            return f"{job.spec['deployment']}: {type(err).__name__}: {err}"
        job.handle = flow_run.id
        job.history.append(str(flow_run.id))
        self.events.emit("start", role=job.role, learner=job.name, deployment=job.spec["deployment"],
                         flow_run_id=str(flow_run.id), restarts=job.restarts)
        log.info("run %s: %s %s submitted to %s as flow run %s", self.ctx.run_id, job.role, job.name,
                 job.spec["deployment"], flow_run.id)
        return None

    def _adopt(self, job: Job) -> bool:
        """Take over a live flow run of this job left by an earlier train run of the same run id, rather
        than start a second process under the same learner name."""
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterState,
            FlowRunFilterStateType,
            FlowRunFilterTags,
        )
        from prefect.client.schemas.objects import StateType
        from prefect.client.schemas.sorting import FlowRunSort

        tags = [t for t in job.spec["tags"] if t.startswith(("run:", "role:", "learner:"))]
        live = FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING])
        try:
            runs = self.client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=tags),
                                              state=FlowRunFilterState(type=live)),
                sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1)
        except self._api_errors() as err:
            log.warning("could not look for a live flow run of %s: %s", job.name, err)
            return False
        if not runs:
            return False
        job.handle = runs[0].id
        job.history.append(str(runs[0].id))
        self.events.emit("adopt", role=job.role, learner=job.name, flow_run_id=str(runs[0].id))
        return True

    def state(self, job: Job) -> tuple[str, Any]:
        """The flow run's state; a run this backend cancelled counts as ended at once."""
        if job.spec.get("cancelled") == job.handle:
            return ENDED, "CANCELLED"
        try:
            state = self.client.read_flow_run(job.handle).state
        except self._api_errors() as err:
            log.warning("state of %s unknown: %s", job.name, err)
            return UNKNOWN, None
        name = state.type.value if state else "PENDING"
        if name in FINAL_STATES:
            log.warning("%s %s: flow run %s ended %s", job.role, job.name, job.handle, name)
            job.spec["final_message"] = state.message  # why, for failure_detail
            return ENDED, name
        return (RUNNING, None) if name == "RUNNING" else (STARTING, None)

    def failure_detail(self, job: Job) -> tuple[str | None, str | None]:
        """(the state message of the job's last flow run, that flow run: where its logs are)."""
        where = f"Prefect flow run {job.history[-1]} (its logs)" if job.history else None
        return job.spec.get("final_message") or None, where

    def kill(self, job: Job, reason: str) -> None:
        """Ask the job's worker to kill its flow run (Cancelling); the job counts as ended from now."""
        from prefect.states import Cancelling

        try:
            self.client.set_flow_run_state(job.handle, Cancelling(message=reason), force=True)
        except self._api_errors() as err:
            log.warning("could not cancel %s: %s", job.name, err)
        job.spec["cancelled"] = job.handle
        self.events.emit("kill", role=job.role, learner=job.name, flow_run_id=str(job.handle), reason=reason)

    def pause(self, job: Job) -> bool:
        return False  # a flow run on a remote worker cannot be stopped where it is

    def resume(self, job: Job) -> bool:
        return False

    def tick(self, sup: Supervisor, now: float) -> None:
        pass

    def close(self) -> None:
        pass


def deployment_supervisor(ctx: RunContext, client: SyncPrefectClient, learners: dict[str, str], *,
                          merger_deployment: str = MERGER_DEPLOYMENT,
                          evaluator_deployment: str = EVALUATOR_DEPLOYMENT,
                          aws_credentials_block: str | None = None,
                          events: EventLog | None = None) -> Supervisor:
    """A supervisor whose roles are runs of their deployments (the `train` flow's deployment mode)."""
    events = events or EventLog(ctx.store, ctx.keys, "supervisor")
    sup = Supervisor(ctx, DeploymentBackend(ctx, client, events), events=events)
    add_deployment_jobs(sup, learners, merger_deployment, evaluator_deployment, aws_credentials_block)
    return sup

"""Learner tasks: join, and one phase (inner steps + publish + heartbeat)."""

from __future__ import annotations

from collections.abc import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from diloco.learner.learner import Learner, PhaseStats
from diloco.run.loops import learner_step
from diloco.tasks.common import retry_on_transient


@task(name="join", cache_policy=NO_CACHE, retries=5, retry_delay_seconds=2, retry_condition_fn=retry_on_transient)
def join_task(learner: Learner) -> int:
    return learner.join()


@task(name="phase", cache_policy=NO_CACHE)
def phase_task(learner: Learner, should_stop: Callable[[], bool]) -> PhaseStats:
    return learner_step(learner, should_stop)

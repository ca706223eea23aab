"""Learner tasks: join, and one phase (inner steps + publish + heartbeat)."""

from __future__ import annotations

from collections.abc import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from diloco.learner.learner import Learner, PhaseStats
from diloco.learner.loop import learner_step


@task(name="join", cache_policy=NO_CACHE)
def join_task(learner: Learner) -> int:
    """The join; storage trouble is retried by the one join loop (run_learner's join_with_retry), not here."""
    return learner.join()


@task(name="phase", cache_policy=NO_CACHE)
def phase_task(learner: Learner, should_stop: Callable[[], bool]) -> PhaseStats:
    return learner_step(learner, should_stop)

"""The operator's controls from Python: admit, remove, readmit, pause and resume merges, live settings, fork
(diloco.supervise.operate, where the CLI and the Prefect `operate` flow find them too), and `resume`, which
continues a finished, stopped or idle run and supervises it to its end.

Contract: the controls' (diloco.supervise.operate): a bad input raises RunError / ConfigError / InvalidName
naming the problem with nothing written, a good one files one control op; `resume` runs the run's roles the
way `diloco resume` does (diloco.api.supervise) and returns why the run ended.
"""

from __future__ import annotations

from collections.abc import Callable

from diloco.inspect.fork import fork
from diloco.run.context import open_run
from diloco.storage import open_store
from diloco.storage.store import Store
from diloco.supervise.operate import (
    admit_learner,
    parse_assignments,
    pause_merges,
    prepare_resume,
    readmit,
    remove_learner,
    resume_merges,
    run_state,
    set_settings,
)

__all__ = ["admit_learner", "fork", "parse_assignments", "pause_merges", "prepare_resume", "readmit",
           "remove_learner", "resume", "resume_merges", "run_state", "set_settings"]


def resume(storage: str | Store, run_id: str, *, versions: int | None = None,
           time_limit_s: float | None = None,
           prefect: bool | None = None, by: str | None = None,
           announce: Callable[[str], None] | None = None) -> str:
    """prepare_resume, then supervise every role of the run until it ends (diloco.api.supervise); why it
    ended. `prefect` None: as the run was last supervised (with Prefect or without)."""
    from diloco import api

    plan = prepare_resume(storage, run_id, versions=versions, time_limit_s=time_limit_s, by=by)
    ctx = open_run(open_store(storage) if isinstance(storage, str) else storage, run_id)  # the new target
    if announce:
        announce(f"run {run_id}: {plan['state']} at version {plan['latest']}; target raised to "
                 f"{plan['target']}")
    prefect = plan["prefect"] if prefect is None else prefect
    return api.supervise(ctx, prefect=prefect, **({"announce": announce} if announce else {}))

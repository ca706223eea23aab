"""A run's roles as processes of this machine, supervised to the end, with an optional chaos plan.

Contract: no Prefect import here (a plain local run does not pay for it); the `train` flow's local mode and
diloco.api use it; the chaos agent (a leaf package the core never imports) is attached from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from diloco.run.context import RunContext


def supervise_local(ctx: RunContext, *, prefect: bool, log_dir: str | None, chaos_plan: str | None = None,
                    on_tick: Callable[[Any], None] | None = None, env: dict[str, str] | None = None) -> str:
    """Start every role (with `env` added to their environment), heal, stop at the end, shut down; returns
    why the run ended."""
    from diloco.supervise.local import local_supervisor

    supervisor = local_supervisor(ctx, prefect=prefect, log_dir=log_dir, env=env)
    if chaos_plan:
        from diloco.chaos.agent import attach_chaos

        attach_chaos(supervisor, chaos_plan)
    return supervisor.run_to_end(on_tick=on_tick)


def check_chaos_plan(path: Any) -> None:
    """Validate a fault plan (ConfigError naming the problem) before anything of the run is created."""
    from diloco.chaos.plan import load_plan

    load_plan(path)

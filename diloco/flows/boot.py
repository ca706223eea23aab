"""What a local Prefect run does while its Prefect server boots, so the ~10 s of the server's start are not
added to the roles' start: the zygote's imports (torch, prefect, the flows) and this process's own.

Contract: never blocks on the server; the zygote started here is taken by the run's supervisor
(supervise/zygote.py take_early) or closed by the caller (close_early).
"""

from __future__ import annotations

import os

from diloco.run.context import RunContext


def boot_local_run(ctx: RunContext, log_dir: str | None) -> None:
    """Start the run's zygote (start_method fork, not on CUDA) and import prefect and the train flow here."""
    from diloco.supervise.zygote import forks_roles, start_early

    if forks_roles(ctx.cfg):
        log_path = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            log_path = os.path.join(log_dir, "zygote.log")
        start_early(ctx.run_id, dict(os.environ), log_path, flows=True)
    import prefect  # noqa: F401 - the imports, while the server boots

    import diloco.flows.train  # noqa: F401

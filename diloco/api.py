"""A supervised run from Python: create it in the bucket, supervise every role until it ends, summarize it.

Contract: what `diloco run` does, without the terminal: `create(...)` validates everything (config, corpus,
chaos plan, run id) before anything is written and creates (or joins, same config) the run; `supervise(...)`
runs it to its end — locally with processes, or as the Prefect `train` flow (a local Prefect server is
started when PREFECT_API_URL is unset, and stopped after) — and returns why it ended. The summary comes from
the bucket (diloco.inspect.report.summarize), never from in-memory counters.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from diloco.configs import Config, load_config
from diloco.run.context import RunContext, create_run
from diloco.storage import open_store

STATE_DIR = Path(".diloco")  # logs and the local Prefect server's home, under the current directory
log = logging.getLogger("diloco.api")


def resolve_config(config: str | Config = "demo", overrides: dict[str, Any] | None = None) -> Config:
    """A recipe name, a YAML path or a Config, with dotted overrides (None values are ignored) validated."""
    cfg = config if isinstance(config, Config) else load_config(config)
    return cfg.with_overrides(overrides or {})


def create(cfg: Config, run_id: str | None = None, chaos: str | Path | None = None) -> RunContext:
    """Validate, then create the run (or join it with the same config); nothing is written on a bad input."""
    from diloco.run.corpus import load_run_corpus
    from diloco.storage.keys import validate_run_id

    run_id = validate_run_id(run_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if chaos is not None:
        from diloco.flows.local import check_chaos_plan

        check_chaos_plan(chaos)  # validate before anything is created
    load_run_corpus(cfg.data)  # a bad corpus fails here, before the run exists
    return create_run(open_store(cfg.run.storage), run_id, cfg)


@contextlib.contextmanager
def prefect_api(announce: Callable[[str], None] = log.info,
                while_booting: Callable[[], None] | None = None) -> Iterator[str]:
    """The Prefect API to report to: PREFECT_API_URL, or a local server started now and stopped after;
    `while_booting` runs while a started server boots (its ~10 s overlap other start-up work)."""
    from diloco.flows.server import api_settings, ensure_api, stop_api, wait_healthy

    url, server = ensure_api(STATE_DIR / "prefect", wait=False)
    try:
        if while_booting is not None:
            while_booting()
        if server is not None:
            wait_healthy(url, server)
        announce(f"Prefect API {url} (UI: {url.removesuffix('/api')})")
        with api_settings(url):
            yield url
    finally:
        stop_api(server)


def supervise(ctx: RunContext, *, prefect: bool = True, chaos: str | Path | None = None,
              announce: Callable[[str], None] = log.info) -> str:
    """Run every role of the run until it ends (target version, stop request, time limit); why it ended."""
    log_dir = str(STATE_DIR / "logs" / ctx.run_id)
    plan = str(chaos) if chaos else None
    if prefect:
        from diloco.flows.boot import boot_local_run
        from diloco.supervise.zygote import close_early

        try:
            with prefect_api(announce, lambda: boot_local_run(ctx, log_dir)):
                from prefect import tags

                from diloco.flows.train import train_flow

                with tags(f"run:{ctx.run_id}", "role:train"):
                    return train_flow(ctx.store.url, ctx.run_id, log_dir=log_dir, chaos_plan=plan)["reason"]
        finally:
            close_early(ctx.run_id)  # an early zygote the supervisor did not take (it failed first)
    from diloco.flows.local import supervise_local

    return supervise_local(ctx, prefect=False, log_dir=log_dir, chaos_plan=plan)

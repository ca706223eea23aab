"""A supervised run from Python: create it in the bucket, supervise every role until it ends, summarize it.

Contract: what `diloco run` does, without the terminal (callers use the names diloco.api exports):
`create(...)` validates everything (config, corpus, chaos plan, run id) before anything is written and creates
(or joins, same config) the run; `supervise(...)` runs it to its end — locally with processes, or as the
Prefect `train` flow (a local Prefect server is started when PREFECT_API_URL is unset, and stopped after) —
and returns why it ended. The summary comes from the bucket (diloco.inspect.report.summarize), never from
in-memory counters.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

from diloco.api.summary import RunSummary
from diloco.configs import Config, ConfigError, load_config
from diloco.run.context import RunContext
from diloco.run.create import create_run
from diloco.storage import open_store

STATE_DIR = Path(".diloco")  # logs and the local Prefect server's home, under the current directory
log = logging.getLogger("diloco.api")


def resolve_config(config: str | Config = "demo", overrides: dict[str, Any] | None = None) -> Config:
    """A recipe name, a YAML path or a Config, with dotted overrides (None values are ignored) validated."""
    cfg = config if isinstance(config, Config) else load_config(config)
    return cfg.with_overrides(overrides or {})


def create(cfg: Config, run_id: str | None = None, chaos: str | Path | None = None) -> RunContext:
    """Validate, then create the run (or join it with the same config); nothing is written on a bad input
    (create_run builds the spec, checks its model and runs its functions once before it writes)."""
    from diloco.storage.keys import validate_run_id

    run_id = validate_run_id(run_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_local_device(cfg)
    if chaos is not None:
        from diloco.launch import check_chaos_plan

        check_chaos_plan(chaos)  # validate before anything is created
    return create_run(open_store(cfg.run.storage), run_id, cfg)


def check_local_device(cfg: Config) -> None:
    """ConfigError when the run's roles, started on this machine, could not use its learner.device (every
    learner would crash at start, and the run end with nothing trained)."""
    from diloco.training.inner import pick_device

    try:
        pick_device(cfg.learner.device)  # the learners' own refusal, before anything is written
    except ValueError as err:
        raise ConfigError(f"{err}, and a run started here trains here; use learner.device 'auto' or "
                          "'cpu'") from None


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
    """Run every role of the run until it ends (target version, stop request, time limit), then score what
    the evaluator did not reach (version 0, the final version); why it ended."""
    from diloco.evaluator.evaluator import evaluate_missing

    reason = _supervise(ctx, prefect=prefect, chaos=chaos, announce=announce)
    evaluate_missing(ctx)
    return reason


def _supervise(ctx: RunContext, *, prefect: bool, chaos: str | Path | None,
               announce: Callable[[str], None]) -> str:
    log_dir = str(STATE_DIR / "logs" / ctx.run_id)
    plan = str(chaos) if chaos else None
    if prefect:
        from diloco.flows.boot import boot_local_run
        from diloco.supervise.zygote import close_early

        try:
            with prefect_api(announce, lambda: boot_local_run(ctx, log_dir)):
                from prefect import tags

                from diloco.flows.train import train_flow
                from diloco.inspect.outcome import RunFailed
                from diloco.run.signals import read_stop_reason

                with tags(f"run:{ctx.run_id}", "role:train"):
                    try:
                        return train_flow(ctx.store.url, ctx.run_id, log_dir=log_dir,
                                          chaos_plan=plan)["reason"]
                    # the flow run is Failed; the caller reads why from the bucket's summary
                    except RunFailed:
                        return read_stop_reason(ctx) or "failed"
        finally:
            close_early(ctx.run_id)  # an early zygote the supervisor did not take (it failed first)
    from diloco.launch import chaos_agent
    from diloco.supervise.local import supervise_local

    return supervise_local(ctx, prefect=False, log_dir=log_dir, attach=chaos_agent(plan))


def train(spec: Callable[..., Any] | str | None = None, *, config: str | Config = "demo",
          spec_args: dict[str, Any] | None = None, learners: int | None = None, versions: int | None = None,
          tokens: int | None = None, storage: str | None = None, run_id: str | None = None,
          time_limit_s: float | None = None,
          overrides: dict[str, Any] | None = None, prefect: bool = False,
          chaos: str | Path | None = None) -> RunSummary:
    """Train a TrainSpec with the same supervised run as `diloco run`; returns what `diloco run --json` prints
    (a RunSummary, diloco.api.summary), or raises diloco.RunFailed (carrying it as `.summary`) when the run
    failed: a learner failed for a reason a restart cannot fix or was given up, no learner contributed, or the
    run ended short for a reason other than the target, the user's stop or the time limit
    (diloco.inspect.outcome). A time limit that ended it short is `extra.ended_by` "time limit" with
    `extra.short_of_target` true.

    `spec` is the factory itself (a module-level function; in a script, guard the call with
    `if __name__ == "__main__":`, since the learner processes import the script to find the factory) or its
    "module:function" / "file.py:function" reference; None keeps the recipe's (the built-in GPT).
    `config` is a recipe name, a YAML path or a Config; `overrides` are dotted keys; `versions` and `tokens`
    (a token budget: run.num_tokens) end the run, whichever comes first. Without Prefect by
    default (prefect=True reports to PREFECT_API_URL, or a local server started for the run).
    """
    from diloco.inspect.outcome import RunFailed
    from diloco.inspect.report import summary_json
    from diloco.inspect.summary import build_summary
    from diloco.specs.loader import reference_of

    cfg = resolve_config(config, {
        **(overrides or {}), "run.num_learners": learners, "run.num_versions": versions,
        "run.num_tokens": tokens,
        "run.storage": storage, "run.time_limit_s": time_limit_s,
        "spec": reference_of(spec) if spec is not None else None, "spec_args": spec_args})
    ctx = create(cfg, run_id, chaos)
    supervise(ctx, prefect=prefect, chaos=chaos)
    summary = build_summary(ctx)
    if summary["failure"]:
        raise RunFailed(f"run {ctx.run_id} failed: {summary['failure']}", summary_json(summary))
    return cast(RunSummary, summary_json(summary))

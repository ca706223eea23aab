"""`diloco learner`, `diloco merge`, `diloco evaluate`: one role of an existing run, in this process.

Contract: what a regional deployment or an operator runs by hand; the role is started through the one launch
entry (diloco.launch.run_role), or as its Prefect flow with --prefect; bad arguments are one line, exit 2, and
so is a learner or merger asked of a run that has finished or stopped (the line says how to continue it).
"""

from __future__ import annotations

import logging
import sys

import typer

from diloco.cli.errors import user_errors
from diloco.cli.options import DEPLOY_AND_SECURITY, PREFECT, RUN_ID, STORAGE

app = typer.Typer()


def _logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def _run(role: str, storage: str, run_id: str, name: str | None, prefect: bool, **counts: int | None) -> None:
    with user_errors():
        if role != "evaluator":  # an evaluator on an ended run still scores what is missing
            from diloco.run.context import open_run
            from diloco.run.state import refuse_if_ended

            refuse_if_ended(open_run(storage, run_id),
                            f"do for {'a learner' if role == 'learner' else 'a merger'}")
        if prefect:
            from diloco.flows.roles import run_flow_role

            run_flow_role(role, storage, run_id, name, **counts)
            return
        from diloco.launch import run_role

        run_role(role, storage, run_id, name, **counts)


@app.command(rich_help_panel=DEPLOY_AND_SECURITY)
def learner(
    storage: str = STORAGE, run_id: str = RUN_ID,
    name: str = typer.Option(..., "--learner", help="This learner's name: [a-z0-9-]{1,48}."),
    phases: int = typer.Option(None, "--phases", min=1, help="Stop after this many phases."),
    prefect: bool = PREFECT, verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO."),
    standby: bool = typer.Option(False, "--standby", help="Warm standby: import everything, then start on a "
                                 "line on stdin (exit on end of input); no bucket access before."),
) -> None:
    """Run one learner of an existing run (what a regional deployment runs)."""
    _logging(verbose)
    with user_errors():
        from diloco.storage.keys import validate_learner_name

        validate_learner_name(name)
    if standby:
        from diloco.launch import wait_as_standby, warm_up

        warm_up()
        if prefect:
            from diloco.flows.roles import warm_up_flows

            warm_up_flows()
        if not wait_as_standby():
            return
    _run("learner", storage, run_id, name, prefect, phases=phases)


@app.command(rich_help_panel=DEPLOY_AND_SECURITY)
def merge(
    storage: str = STORAGE, run_id: str = RUN_ID,
    merges: int = typer.Option(None, "--merges", min=1, help="Stop after this many merges."),
    merger_id: str = typer.Option("merger", "--merger-id", help="Name in manifests and events."),
    prefect: bool = PREFECT, verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO."),
) -> None:
    """Run the outer merger of an existing run."""
    _logging(verbose)
    _run("merger", storage, run_id, merger_id, prefect, merges=merges)


@app.command(rich_help_panel=DEPLOY_AND_SECURITY)
def evaluate(storage: str = STORAGE, run_id: str = RUN_ID, prefect: bool = PREFECT) -> None:
    """Evaluate committed versions on the held-out data until the run stops."""
    _logging()
    _run("evaluator", storage, run_id, None, prefect)

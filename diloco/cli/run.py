"""`diloco run` and `diloco status`: set up a run, supervise it with a live view, summarize it.

Contract: the run is created (or joined, same config) before any process starts (diloco.api); the summary
and JSON are computed from the bucket, never from in-memory counters.
"""

from __future__ import annotations

from pathlib import Path

import typer

from diloco.cli.errors import user_errors
from diloco.cli.options import JSON, RUN_AND_INSPECT, RUN_ID, STORAGE

app = typer.Typer()


@app.command(rich_help_panel=RUN_AND_INSPECT)
def run(
    config: str = typer.Option("demo", "--config", help="Recipe name (tiny, demo, bench) or a YAML path."),
    storage: str = typer.Option(None, "--storage", help="Storage URL (default: the recipe's, file://runs)."),
    learners: int = typer.Option(None, "--learners", help="Number of learners."),
    versions: int = typer.Option(None, "--versions", help="Stop after this many committed versions."),
    tokens: int = typer.Option(None, "--tokens", help="Or once the versions carry this many merged tokens "
                               "(a token budget; 0: none; default: the recipe's run.num_tokens)."),
    corpus: str = typer.Option(None, "--corpus", help="Text file, folder of text files, or fsspec URL."),
    run_id: str = typer.Option(None, "--run-id", help="Run id (default: <recipe>-<time>)."),
    json_out: bool = typer.Option(False, "--json", help="End with one JSON object of the results."),
    prefect: bool = typer.Option(True, "--prefect/--no-prefect",
                                 help="Report to Prefect (starts a local server if PREFECT_API_URL is "
                                      "unset)."),
    chaos: Path = typer.Option(None, "--chaos", help="A YAML fault plan to apply to the run."),
    time_limit_s: float = typer.Option(None, "--time-limit-s", help="Stop the run after this many seconds."),
    live: bool = typer.Option(True, "--live/--no-live", help="Show a live progress table."),
    spec: str = typer.Option(None, "--spec",
                             help="Your TrainSpec: path/to/file.py:make_spec or package.module:make_spec "
                             "(default: the recipe's, the built-in GPT)."),
    spec_arg: list[str] = typer.Option(None, "--spec-arg",
                                       help="key=value for the spec's factory (repeatable; "
                                       "values parsed as YAML scalars)."),
    override: list[str] = typer.Option(None, "--override", "-o",
                                       help="key=value config override at creation, e.g. "
                                       "-o inner.steps_per_phase=20 (repeatable; values parsed as YAML)."),
) -> None:
    """Train: create the run, start merger, evaluator and learners as processes, report at the end."""
    from diloco.flows.server import close_early, launch_early

    home = Path(".diloco") / "prefect"  # diloco.api.STATE_DIR, without importing the engine first
    if prefect and _config_loads(config):
        launch_early(home)  # the local server boots while the engine imports and the run is created
    try:
        from diloco.cli.view import execute_run

        with user_errors():
            execute_run(config=config, storage=storage, learners=learners, versions=versions, tokens=tokens,
                        corpus=corpus, run_id=run_id, json_out=json_out, prefect=prefect, chaos=chaos,
                        time_limit_s=time_limit_s, live=live, spec=spec, spec_args=spec_arg or [],
                        overrides=override or [])
    finally:
        close_early(home)  # only if the run never took it (a bad config, a refused run)


def _config_loads(config: str) -> bool:
    """Whether the recipe or YAML file loads (0.5 s, before the engine's imports); a bad one is reported by
    execute_run, with no server started for it."""
    from diloco.configs import ConfigError, load_config

    try:
        load_config(config)
    except ConfigError:
        return False
    return True


@app.command(rich_help_panel=RUN_AND_INSPECT)
def status(storage: str = STORAGE, run_id: str = RUN_ID, json_out: bool = JSON) -> None:
    """Versions, and each learner's last heartbeat, seq, base version and loss."""
    from diloco.cli.view import print_status

    with user_errors():
        print_status(storage, run_id, json_out)

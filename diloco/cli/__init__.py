"""The `diloco` command line: run a job, run one learner or the merger, inspect, audit, benchmark.

Contract: every bad argument is a clear one-line error naming it (exit 2) and changes nothing.
The core commands import their engine inside the command; the benchmark and plot modules load
torch when registered, so `--help` costs one torch import (about 2 s on an idle machine).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import typer

from diloco.bench.bandwidth import bandwidth
from diloco.bench.codec import bench_codec
from diloco.bench.goodput import bench_goodput
from diloco.bench.merge import bench_merge
from diloco.bench.outage import bench_outage
from diloco.bench.quality import bench_quality
from diloco.supervise.deployments import remove_learner
from diloco.inspect.plot import plot_run
from diloco.sim.cli import simulate_goodput

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Decoupled DiLoCo on object storage: learners and an outer merge that only talk to a bucket.",
)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: each prints a table and can write JSON.")
app.add_typer(bench_app, name="bench")
bench_app.command("codec")(bench_codec)
bench_app.command("goodput")(bench_goodput)
bench_app.command("quality")(bench_quality)
bench_app.command("merge")(bench_merge)
bench_app.command("outage")(bench_outage)
app.command("bandwidth")(bandwidth)
app.command("simulate-goodput")(simulate_goodput)
app.command("plot")(plot_run)
app.command("remove-learner")(remove_learner)

STORAGE = typer.Option(..., "--storage", help="Where the run lives: file://DIR, s3://bucket/prefix, any fsspec URL.")
RUN_ID = typer.Option(..., "--run-id", help="The run's id (its folder in the bucket).")
PREFECT = typer.Option(False, "--prefect/--no-prefect", help="Run as a Prefect flow reporting to PREFECT_API_URL.")
STATE_DIR = Path(".diloco")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg="red")
    raise typer.Exit(2)


@contextmanager
def user_errors():
    """Turn the errors a user can cause into one clear line and exit code 2."""
    from diloco.configs import ConfigError
    from diloco.run.context import RunError
    from diloco.storage import StorageError
    from diloco.storage.keys import InvalidName
    from diloco.training.data import DataError

    try:
        yield
    except (ConfigError, RunError, InvalidName, DataError) as err:
        _fail(str(err))
    except StorageError as err:
        _fail(f"storage: {type(err).__name__}: {err}")


def _logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


@app.command()
def run(
    config: str = typer.Option("demo", "--config", help="Recipe name (tiny, demo, bench) or a YAML path."),
    storage: str = typer.Option(None, "--storage", help="Storage URL (default: the recipe's, file://runs)."),
    learners: int = typer.Option(None, "--learners", help="Number of learners."),
    versions: int = typer.Option(None, "--versions", help="Stop after this many committed versions."),
    corpus: str = typer.Option(None, "--corpus", help="Text file, folder of text files, or fsspec URL."),
    run_id: str = typer.Option(None, "--run-id", help="Run id (default: <recipe>-<time>)."),
    json_out: bool = typer.Option(False, "--json", help="End with one JSON object of the results."),
    prefect: bool = typer.Option(True, "--prefect/--no-prefect", help="Report to Prefect (starts a local server if PREFECT_API_URL is unset)."),
    chaos: Path = typer.Option(None, "--chaos", help="A YAML fault plan to apply to the run."),
    time_limit_s: float = typer.Option(None, "--time-limit-s", help="Stop the run after this many seconds."),
    live: bool = typer.Option(True, "--live/--no-live", help="Show a live progress table."),
) -> None:
    """Train: create the run, start merger, evaluator and learners as processes, report at the end."""
    from diloco.cli.run import execute_run

    with user_errors():
        execute_run(config=config, storage=storage, learners=learners, versions=versions, corpus=corpus,
                    run_id=run_id, json_out=json_out, prefect=prefect, chaos=chaos,
                    time_limit_s=time_limit_s, live=live)


@app.command()
def learner(
    storage: str = STORAGE, run_id: str = RUN_ID,
    name: str = typer.Option(..., "--learner", help="This learner's name: [a-z0-9-]{1,48}."),
    phases: int = typer.Option(None, "--phases", min=1, help="Stop after this many phases."),
    prefect: bool = PREFECT, verbose: bool = typer.Option(False, "--verbose", "-v"),
    standby: bool = typer.Option(False, "--standby", help="Warm standby: import everything, then start on a "
                                 "line on stdin (exit on end of input); no bucket access before."),
) -> None:
    """Run one learner of an existing run (what a regional deployment runs)."""
    _logging(verbose)
    with user_errors():
        from diloco.storage.keys import validate_learner_name

        validate_learner_name(name)
        if standby:
            from diloco.launch import wait_as_standby

            if not wait_as_standby(prefect):
                return
        if prefect:
            from prefect import tags

            from diloco.flows.learner import learner_flow

            with tags(f"run:{run_id}", f"learner:{name}", "role:learner"):
                learner_flow(storage, run_id, name, phases)
            return
        from diloco.run.loops import run_learner
        from diloco.launch import make_learner

        worker, should_stop = make_learner(storage, run_id, name)
        run_learner(worker, phases=phases, should_stop=should_stop)


@app.command()
def merge(
    storage: str = STORAGE, run_id: str = RUN_ID,
    merges: int = typer.Option(None, "--merges", min=1, help="Stop after this many merges."),
    merger_id: str = typer.Option("merger", "--merger-id", help="Name in manifests and events."),
    prefect: bool = PREFECT, verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run the outer merger of an existing run."""
    _logging(verbose)
    with user_errors():
        from diloco.storage.keys import validate_learner_name

        validate_learner_name(merger_id)
        if prefect:
            from prefect import tags

            from diloco.flows.outer_merge import outer_merge_flow

            with tags(f"run:{run_id}", "role:merger"):
                outer_merge_flow(storage, run_id, merges, merger_id)
            return
        from diloco.run.loops import StopSignal
        from diloco.merger.merger import run_merger
        from diloco.launch import make_merger

        merger, ctx = make_merger(storage, run_id, merger_id)
        run_merger(merger, max_merges=merges, target_version=ctx.cfg.run.num_versions, should_stop=StopSignal(ctx))


@app.command()
def evaluate(storage: str = STORAGE, run_id: str = RUN_ID, prefect: bool = PREFECT) -> None:
    """Evaluate committed versions on the held-out text until the run stops."""
    _logging()
    with user_errors():
        if prefect:
            from prefect import tags

            from diloco.flows.evaluate import evaluate_flow

            with tags(f"run:{run_id}", "role:evaluate"):
                evaluate_flow(storage, run_id)
            return
        from diloco.run.loops import run_evaluator
        from diloco.launch import make_evaluator

        evaluator, should_stop = make_evaluator(storage, run_id)
        run_evaluator(evaluator, should_stop=should_stop)


@app.command()
def status(storage: str = STORAGE, run_id: str = RUN_ID,
           json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Versions, and each learner's last heartbeat, seq, base version and loss."""
    with user_errors():
        from diloco.cli.run import print_status

        print_status(storage, run_id, json_out)


@app.command()
def audit(storage: str = STORAGE, run_id: str = RUN_ID,
          json_out: bool = typer.Option(False, "--json", help="Print JSON."),
          replay: bool = typer.Option(True, "--replay/--no-replay", help="Replay every merge bit for bit.")) -> None:
    """Check the manifest chain, checksums, at-most-once merging, and replay every merge."""
    with user_errors():
        from diloco.inspect.audit import audit_run
        from diloco.run.context import open_run

        report = audit_run(open_run(storage, run_id), do_replay=replay)
        if json_out:
            typer.echo(json.dumps(report.to_json()))
        else:
            verdict = "OK" if report.ok else "FAILED"
            typer.echo(f"audit {verdict}: {report.num_versions} versions, {report.deltas_merged} deltas merged, "
                       f"{report.deltas_rejected} rejected, {report.deltas_lost} lost, "
                       f"{report.deltas_pending} pending, replay {'ok' if report.replay_ok else 'FAILED'}")
            for p in report.problems:
                typer.echo(f"  - {p}")
        if not report.ok:
            raise typer.Exit(1)


@app.command("gc")
def gc(storage: str = STORAGE, run_id: str = RUN_ID,
       min_age_s: float = typer.Option(600.0, "--min-age-s", min=0, help="Only orphans older than this."),
       dry_run: bool = typer.Option(False, "--dry-run", help="List what would be deleted.")) -> None:
    """Delete objects under global/ that no manifest references (left by crashed merges)."""
    with user_errors():
        from diloco.inspect.gc import collect_orphans
        from diloco.run.context import open_run

        report = collect_orphans(open_run(storage, run_id), min_age_s=min_age_s, dry_run=dry_run)
        verb = "would delete" if dry_run else "deleted"
        typer.echo(f"{len(report.orphans)} orphans, {verb} {len(report.orphans) - len(report.too_young) if dry_run else len(report.deleted)}, "
                   f"{len(report.too_young)} younger than {min_age_s:g}s kept; {report.referenced} objects referenced")


@app.command("stop")
def stop(storage: str = STORAGE, run_id: str = RUN_ID,
         reason: str = typer.Option("operator", "--reason")) -> None:
    """Ask every process of a run to end after its current phase (writes control/stop)."""
    with user_errors():
        from diloco.run.loops import request_stop
        from diloco.run.context import open_run

        request_stop(open_run(storage, run_id), reason)
        typer.echo(f"stop requested for run {run_id}")


def main() -> None:  # pragma: no cover - entry point
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

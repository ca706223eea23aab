"""Operator commands on an existing run: audit, gc, stop, remove-learner, plot.

Contract: each reads (and, for stop and remove-learner, writes one control object in) the run's storage
only; bad arguments are one line, exit 2; `audit` exits 1 when the history does not hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from diloco.cli.errors import user_errors
from diloco.cli.options import JSON, OPERATE, RUN_AND_INSPECT, RUN_ID, STORAGE

app = typer.Typer()


@app.command(rich_help_panel=RUN_AND_INSPECT)
def audit(storage: str = STORAGE, run_id: str = RUN_ID, json_out: bool = JSON,
          replay: bool = typer.Option(True, "--replay/--no-replay",
                                      help="Replay every merge bit for bit.")) -> None:
    """Check the manifest chain, checksums, at-most-once merging, and replay every merge."""
    with user_errors():
        from diloco.inspect.audit import audit_run
        from diloco.launch import keyring_of_env
        from diloco.run.context import open_run

        ctx = open_run(storage, run_id, check_pin=False)  # a changed run.json is audit's to report
        report = audit_run(ctx, do_replay=replay, keyring=keyring_of_env(required=False))
        if json_out:
            typer.echo(json.dumps(report.to_json()))
        else:
            verdict = "OK" if report.ok else "FAILED"
            typer.echo(f"audit {verdict}: {report.num_versions} versions, {report.deltas_merged} deltas "
                       f"merged, {report.deltas_rejected} rejected, {report.deltas_lost} lost, "
                       f"{report.deltas_pending} pending, replay {'ok' if report.replay_ok else 'FAILED'}; "
                       f"{report.decisions_replayed} decisions replayed, {report.controls_applied} control "
                       "ops"
                       + (f"; {report.deltas_ignored} keys ignored (no member's, or too far ahead)"
                          if report.deltas_ignored else ""))
            if any(report.history_from):
                typer.echo(f"  note: gc's retention kept the history from version {min(report.history_from)} "
                           f"(per chain: {report.history_from}); the versions before it are not replayed, "
                           "the kept ones are, from the checkpoint there")
            for p in report.problems:
                typer.echo(f"  - {p}")
            if report.run_json.startswith("not"):
                typer.echo(f"  note: run.json {report.run_json}")
        if not report.ok:
            raise typer.Exit(1)


@app.command("gc", rich_help_panel=OPERATE)
def gc(storage: str = STORAGE, run_id: str = RUN_ID,
       min_age_s: float = typer.Option(600.0, "--min-age-s", min=0, help="Only orphans older than this."),
       keep_versions: int | None = typer.Option(
           None, "--keep-versions", min=1, help="Retention: keep the newest N versions rebuildable; remove "
           "the checkpoints, updates and deltas only older versions need (off by default)."),
       before: int | None = typer.Option(
           None, "--before", min=0, help="Retention: remove what only versions before V need."),
       dry_run: bool = typer.Option(False, "--dry-run", help="List what would be deleted.")) -> None:
    """Delete orphans (objects no manifest names, left by crashed merges); with --keep-versions or --before,
    also the history no kept version needs (recorded in each chain's retention.json: audit then covers what
    is kept)."""
    with user_errors():
        from diloco.inspect.gc import collect_orphans, retain
        from diloco.run.context import open_run

        ctx = open_run(storage, run_id)
        if keep_versions is not None or before is not None:
            kept = retain(ctx, keep_versions=keep_versions, before=before, dry_run=dry_run)
            typer.echo(f"retention: {'would remove' if dry_run else 'removed'} {len(kept.retained)} objects, "
                       f"{kept.retained_bytes / 1e6:,.1f} MB; history kept from version "
                       f"{min(kept.history_from, default=0)}")
        report = collect_orphans(ctx, min_age_s=min_age_s, dry_run=dry_run)
        removed = len(report.orphans) - len(report.too_young) if dry_run else len(report.deleted)
        typer.echo(f"{len(report.orphans)} orphans, {'would delete' if dry_run else 'deleted'} {removed}, "
                   f"{len(report.too_young)} younger than {min_age_s:g}s kept; {report.referenced} objects "
                   "referenced")


@app.command("stop", rich_help_panel=OPERATE)
def stop(storage: str = STORAGE, run_id: str = RUN_ID,
         reason: str = typer.Option("operator", "--reason", help="Recorded in control/stop.")) -> None:
    """Ask every process of a run to end after its current phase (writes control/stop); a finished or stopped
    run is refused (nothing to stop: its stop reason is kept)."""
    with user_errors():
        from diloco.run.context import open_run
        from diloco.run.signals import request_stop
        from diloco.run.state import refuse_if_ended

        ctx = open_run(storage, run_id)
        refuse_if_ended(ctx, "stop")
        request_stop(ctx, reason)
        typer.echo(f"stop requested for run {run_id}")


@app.command("remove-learner", rich_help_panel=OPERATE)
def remove_learner(storage: str = STORAGE, run_id: str = RUN_ID,
                   learner: str = typer.Option(..., "--learner", help="The learner to remove for good."),
                   reason: str = typer.Option("operator", "--reason",
                                              help="Recorded with the removal.")) -> None:
    """Remove a learner from a run: it ends after its phase and no supervisor starts it again."""
    with user_errors():
        from diloco.api.operate import remove_learner as remove
        from diloco.cli.operate import say_if_ended

        remove(storage, run_id, learner, reason=reason)
        typer.echo(f"learner {learner} removed from run {run_id}")
        say_if_ended(storage, run_id)


@app.command("plot", rich_help_panel=RUN_AND_INSPECT)
def plot(storage: str = STORAGE, run_id: str = RUN_ID,
         out: Path = typer.Option(Path("out/run.png"), "--out", help="The PNG to write.")) -> None:
    """Plot a run: held-out loss per version, and a timeline per learner with the merges marked."""
    with user_errors():
        if out.suffix.lower() != ".png":
            raise typer.BadParameter(f"--out {str(out)!r} must end in .png")
        from diloco.inspect.plot import render_run_plot
        from diloco.run.context import open_run

        typer.echo(f"wrote {render_run_plot(open_run(storage, run_id), out)}")

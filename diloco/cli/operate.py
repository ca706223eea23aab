"""Operator controls on a run: admit-learner, readmit, pause-merges, resume-merges, set, resume, fork; and the
trust tools: bucket-policy, keygen, outliers.

Contract: each command calls diloco.api.operate (the functions of diloco.supervise.operate, which the Prefect
`operate` flow calls too); a bad argument or a control that does not fit the run's state is one line, exit 2,
and nothing is written.
"""

from __future__ import annotations

import json

import typer

from diloco.cli.errors import fail, user_errors
from diloco.cli.options import DEPLOY_AND_SECURITY, JSON, OPERATE, RUN_ID, STORAGE

app = typer.Typer()


def say_if_ended(storage: str, run_id: str) -> None:
    """After a control filed on a finished or stopped run: it applies once the run is resumed
    (run/state.py)."""
    from diloco.run.context import open_run
    from diloco.run.state import ended_note

    note = ended_note(open_run(storage, run_id))
    if note:
        typer.echo(note)


LEARNER = typer.Option(..., "--learner", help="The learner's name: [a-z0-9-]{1,48}.")
REASON = typer.Option("", "--reason", help="Recorded with the control op.")


@app.command("admit-learner", rich_help_panel=OPERATE)
def admit_learner(storage: str = STORAGE, run_id: str = RUN_ID, learner: str = LEARNER, reason: str = REASON,
                  start: bool = typer.Option(True, "--start/--no-start",
                                             help="A running supervisor starts it (--no-start: you "
                                                  "run it).")) -> None:
    """Admit one more learner (elastic join): its deltas are merged from the next merge on."""
    with user_errors():
        from diloco.api.operate import admit_learner as admit

        op = admit(storage, run_id, learner, reason=reason, start=start)
        how = "a running supervisor starts it within seconds" if start else "start it with: diloco learner " \
            f"--storage {storage} --run-id {run_id} --learner {learner}"
        typer.echo(f"learner {learner} admitted to run {run_id} (op {op}); {how}")
        say_if_ended(storage, run_id)


@app.command("readmit", rich_help_panel=OPERATE)
def readmit(storage: str = STORAGE, run_id: str = RUN_ID, learner: str = LEARNER,
            reason: str = REASON) -> None:
    """End a learner's quarantine: its deltas are judged again from the next merge on."""
    with user_errors():
        from diloco.api.operate import readmit as do_readmit

        op = do_readmit(storage, run_id, learner, reason=reason)
        typer.echo(f"learner {learner} readmitted to run {run_id} (op {op})")
        say_if_ended(storage, run_id)


@app.command("pause-merges", rich_help_panel=OPERATE)
def pause_merges(storage: str = STORAGE, run_id: str = RUN_ID, reason: str = REASON) -> None:
    """Pause merging: learners train on and publish; nothing is lost (resume-merges takes it all)."""
    with user_errors():
        from diloco.api.operate import pause_merges as pause

        typer.echo(f"merges of run {run_id} paused (op {pause(storage, run_id, reason=reason)})")
        say_if_ended(storage, run_id)


@app.command("resume-merges", rich_help_panel=OPERATE)
def resume_merges(storage: str = STORAGE, run_id: str = RUN_ID, reason: str = REASON) -> None:
    """Resume merging after pause-merges."""
    with user_errors():
        from diloco.api.operate import resume_merges as go

        typer.echo(f"merges of run {run_id} resumed (op {go(storage, run_id, reason=reason)})")
        say_if_ended(storage, run_id)


@app.command("set", rich_help_panel=OPERATE)
def set_settings(storage: str = STORAGE, run_id: str = RUN_ID,
                 assignments: list[str] = typer.Argument(...,
                                                         help="KEY=VALUE, e.g. merger.quorum=3 outer.lr=0.5"),
                 reason: str = REASON,
                 force: bool = typer.Option(False, "--force", help="Set a value that would reject the "
                                            "deltas the run sends now (a max_delta_bytes below their size).")
                 ) -> None:
    """Change live settings from the next merge on (merger.quorum, merger.grace_cap_s, outer.lr, ...); each
    value is read by its field's type (merger.outlier_rule=off is the string off) and must be finite."""
    with user_errors():
        from diloco.api.operate import parse_assignments
        from diloco.api.operate import set_settings as do_set
        from diloco.run.context import open_run
        from diloco.run.controls import read_op

        ctx = open_run(storage, run_id)
        op = do_set(ctx, None, parse_assignments(assignments), reason=reason, force=force)
        values = read_op(ctx.store, ctx.keys, op).values  # as filed: what the next manifest records
        typer.echo(f"run {run_id}: {', '.join(f'{k}={v!r}' for k, v in values.items())} from the next merge "
                   f"(op {op})")
        say_if_ended(storage, run_id)


@app.command("resume", rich_help_panel=OPERATE)
def resume(storage: str = STORAGE, run_id: str = RUN_ID,
           versions: int = typer.Option(None, "--versions",
                                        help="How many MORE versions to train (default: as "
                                        "many as the run was created with)."),
           time_limit_s: float = typer.Option(None, "--time-limit-s", help="This session's time limit."),
           prefect: bool | None = typer.Option(None, "--prefect/--no-prefect",
                                               help="Report to Prefect (as `diloco "
                                               "run`; default: as the run was last supervised)."),
           json_out: bool = JSON, live: bool = typer.Option(True, "--live/--no-live",
                                                            help="Live progress table.")) -> None:
    """Continue a finished or stopped run: raise the target, clear the stop, start the roles; learners rejoin
    at the newest version with their checkpoints and data cursors."""
    with user_errors():
        import os

        from rich.console import Console

        from diloco import api
        from diloco.api.operate import prepare_resume
        from diloco.cli.view import LiveView, exit_for, final_report
        from diloco.run.context import open_run
        from diloco.supervise.interrupt import catch_signals

        with catch_signals():  # Ctrl-C and SIGTERM end the resumed run in order, as `diloco run`
            plan = prepare_resume(storage, run_id, versions=versions, time_limit_s=time_limit_s)
            ctx = open_run(storage, run_id)
            console = Console(stderr=json_out)
            how = ""
            if prefect is None:  # the way the run was started (its last lease's kind); a flag given wins
                prefect = plan["prefect"]
                how = "" if prefect else ", without Prefect as it was started"
            console.print(f"[bold]diloco[/bold] resume of run [cyan]{run_id}[/cyan] ({plan['state']}) at "
                          f"version {plan['latest']}: target {plan['previous_target']} -> "
                          f"{plan['target']}{how}")
            with LiveView(ctx, console, live and console.is_terminal):
                reason = api.supervise(ctx, prefect=prefect, announce=console.print)
            summary = final_report(ctx, console, json_out, reason=reason,
                                   local_ui=prefect and not os.environ.get("PREFECT_API_URL"))
        exit_for(reason, summary)  # a signal's code, or EXIT_CODE when the resumed run failed


@app.command("fork", rich_help_panel=OPERATE)
def fork(storage: str = STORAGE, run_id: str = RUN_ID,
         at_version: int = typer.Option(..., "--at-version",
                                        help="The parent's version that becomes version 0."),
         new_run_id: str = typer.Option(..., "--new-run-id", help="The new run's id."),
         config: str = typer.Option(None, "--config", help="A recipe or YAML for the new run (same model)."),
         overrides: list[str] = typer.Option(None, "--set", help="KEY=VALUE overrides of --config.")) -> None:
    """A new run whose version 0 is this run's version V (params and outer state); the parent is untouched."""
    with user_errors():
        from diloco.api.operate import fork as do_fork
        from diloco.api.operate import parse_assignments

        ctx = do_fork(storage, run_id, at_version, new_run_id, config=config,
                      overrides=parse_assignments(overrides or []))
        typer.echo(f"run {new_run_id} forked from {run_id} at version {at_version}; train it with: "
                   f"diloco resume --storage {storage} --run-id {ctx.run_id}")


@app.command("bucket-policy", rich_help_panel=DEPLOY_AND_SECURITY)
def bucket_policy(storage: str = STORAGE, run_id: str = RUN_ID,
                  learner: str = typer.Option(None, "--learner", help="The policy of this learner."),
                  role: str = typer.Option(None, "--role", help="merger | evaluator | operator | gc "
                                           "(retention: deletes what no kept version needs)")) -> None:
    """Print the least-privilege S3 policy (JSON, for AWS IAM or MinIO `mc admin policy`) of one role of a
    run."""
    with user_errors():
        from diloco.trust.bucket_policy import policy_for

        if (learner is None) == (role is None):
            fail("give exactly one of --learner NAME or --role merger|evaluator|operator|gc")
        typer.echo(json.dumps(policy_for(storage, run_id, learner=learner, role=role), indent=2))


@app.command("keygen", rich_help_panel=DEPLOY_AND_SECURITY)
def keygen(learners: list[str] = typer.Option(..., "--learner",
                                              help="A learner to make a key for (repeat).")) -> None:
    """Fresh signing keys: the keyring (JSON, for the merger's DILOCO_KEYRING) and each learner's key."""
    with user_errors():
        from diloco.storage.keys import validate_learner_name
        from diloco.trust.signing import new_key

        ring = {validate_learner_name(name): new_key() for name in learners}
        typer.echo(json.dumps(ring))


@app.command("outliers", rich_help_panel=DEPLOY_AND_SECURITY)
def outliers(storage: str = STORAGE, run_id: str = RUN_ID, json_out: bool = JSON,
             window: int = typer.Option(None, "--window", min=1, help="Window (default: the run's)."),
             min_samples: int = typer.Option(None, "--min-samples", min=1,
                                             help="Least samples (the run's)."),
             directions: bool = typer.Option(False, "--directions",
                                             help="Also each merged delta's cosine with the other learners' "
                                                  "deltas and with the parent's update (reads every merged "
                                                  "delta).")) -> None:
    """Replay the outlier statistic over a run: each merged delta's norm per step / the running median."""
    with user_errors():
        from diloco.run.context import open_run
        from diloco.trust.outliers import ratios, summarize

        ctx = open_run(storage, run_id)
        summary = summarize(ratios(ctx, window, min_samples))
        if directions:
            from diloco.trust.directions import directions as cosines
            from diloco.trust.directions import summarize_directions

            summary["directions"] = summarize_directions(cosines(ctx))
        if json_out:
            typer.echo(json.dumps(summary))
            return
        fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
        typer.echo(f"{summary['judged']} deltas judged (of {summary['deltas']}), "
                   f"{summary['flagged_outlier']} flagged: ratio max {fmt(summary['max_ratio'])}, p99 "
                   f"{fmt(summary['p99_ratio'])}, median {fmt(summary['median_ratio'])}; would reject: "
                   + ", ".join(f"{k}: {v}" for k, v in summary["would_reject"].items()))
        for name in ("cos_others", "cos_update") if directions else ():
            figures = summary["directions"][name]
            typer.echo(f"{name}: {figures['n']} deltas, min {fmt(figures['min'])}, "
                       f"p1 {fmt(figures['p01'])}, p5 {fmt(figures['p05'])}, "
                       f"median {fmt(figures['median'])}; <= 0: {figures['at_or_below_0']}")

"""The `diloco` command line: run a job, run one role, operate and inspect a run, benchmark.

Contract: every bad argument is a clear one-line error naming it (exit 2) and changes nothing; typer lives
only in this package; commands import their engine (and torch) when they run, so `diloco --help` is fast.
"""

from __future__ import annotations

import os

import typer

from diloco.cli import bench, model, operate, ops, roles, run, runs

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,  # help text is shown as written: `[a-z0-9-]` is a pattern, not markup
    help="Decoupled DiLoCo on object storage: learners and an outer merge that only talk to a bucket.",
)
for group in (run.app, runs.app, roles.app, ops.app, operate.app, model.app, bench.app):
    app.registered_commands.extend(group.registered_commands)
app.add_typer(bench.bench, name="bench")


def main() -> None:  # pragma: no cover - entry point
    # Prefect's usage analytics off unless the environment says otherwise: the server's (the server a run starts
    # has it off regardless: flows/server.py) and, since Prefect 3.9, the SDK's, which on its first import in a
    # terminal prints a notice (through the live table) and reports milestones unless DO_NOT_TRACK is set
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

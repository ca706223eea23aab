"""The `diloco` command line: run and inspect a run, operate a live one, deploy and secure it, benchmark.

Contract: every bad argument is a clear one-line error naming it (exit 2) and changes nothing; typer lives
only in this package; commands import their engine (and torch) when they run, so `diloco --help` is fast;
`--help` lists the commands by audience (cli/options.py PANELS), each under the panel it names.
"""

from __future__ import annotations

import os

import click
import typer
from typer.core import TyperGroup

from diloco.cli import bench, model, operate, ops, roles, run, runs
from diloco.cli.options import BENCHMARKS, PANELS

OTHERS = "Commands"  # click's own title, for a command that names no panel


class ByAudience(TyperGroup):
    """The commands in one section per audience (their rich_help_panel, in PANELS' order), as plain text: the
    help is not rendered by rich (rich_markup_mode None), which would read `[a-z0-9-]` as markup."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        commands = [(name, cmd) for name in self.list_commands(ctx)
                    if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if not commands:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in commands)  # click's own spacing
        for panel in (*PANELS, OTHERS):
            rows = [(name, cmd.get_short_help_str(limit)) for name, cmd in commands if panel_of(cmd) == panel]
            if rows:
                with formatter.section(panel):
                    formatter.write_dl(rows)


def panel_of(command: click.Command) -> str:
    """The audience a command names (its rich_help_panel), or OTHERS: a command is never left out of
    --help."""
    panel = getattr(command, "rich_help_panel", None)
    return panel if panel in PANELS else OTHERS


app = typer.Typer(
    cls=ByAudience,
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,  # help text is shown as written: `[a-z0-9-]` is a pattern, not markup
    help="Decoupled DiLoCo on object storage: learners and an outer merge that only talk to a bucket.",
)
for command in bench.app.registered_commands:  # every command of cli/bench.py is a benchmark
    command.rich_help_panel = BENCHMARKS
for group in (run.app, runs.app, roles.app, ops.app, operate.app, model.app, bench.app):
    app.registered_commands.extend(group.registered_commands)
app.add_typer(bench.bench, name="bench", rich_help_panel=BENCHMARKS)


def main() -> None:  # pragma: no cover - entry point
    # Prefect's usage analytics off unless the environment says otherwise: the server's (the server a run
    # starts has it off regardless: flows/server.py) and, since Prefect 3.9, the SDK's, which on its first
    # import in a terminal prints a notice (through the live table) and reports milestones unless DO_NOT_TRACK
    # is set
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

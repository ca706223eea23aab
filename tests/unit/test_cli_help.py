"""`diloco --help` lists every command once, under its audience (run and inspect; operate a live run; deploy
and security; benchmarks), in that order, with the names the commands always had.

Run: .venv/bin/pytest tests/unit/test_cli_help.py
"""

from __future__ import annotations

from typer.main import get_command
from typer.testing import CliRunner

from diloco.cli import OTHERS, app, panel_of
from diloco.cli.options import PANELS


def test_every_command_names_an_audience() -> None:
    group = get_command(app)
    assert {name: panel_of(cmd) for name, cmd in group.commands.items() if panel_of(cmd) == OTHERS} == {}


def test_the_help_lists_the_audiences_in_order_and_every_command_once() -> None:
    text = CliRunner().invoke(app, ["--help"], terminal_width=200).output
    assert [line.removesuffix(":") for line in text.splitlines()
            if line.endswith(":") and line[0] != " "][1:] == [*PANELS]  # after "Options:"
    listed = [line.split()[0] for line in text.split("Options:")[1].splitlines() if line.startswith("  ")
              and not line.lstrip().startswith("-")]
    assert sorted(listed) == sorted(get_command(app).commands)
    assert text.index("  run ") < text.index("Operate a live run:") < text.index("  stop ") < text.index(
        "Deploy and security:") < text.index("  keygen ") < text.index("Benchmarks:") < text.index("  bench ")

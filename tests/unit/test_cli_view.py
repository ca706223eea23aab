"""`diloco status` at narrow widths: a name too long for the table is shortened from the middle, keeping its
start and its distinguishing suffix, and never so far that two learners read the same; while the live table is
drawn, Prefect's console log goes to the run's log file, not through the table.

Run: .venv/bin/pytest tests/unit/test_cli_view.py
"""

from __future__ import annotations

from diloco.cli.view import MIN_NAME_CHARS, shorten_middle


def test_a_long_name_keeps_its_suffix_and_a_short_one_stays_whole() -> None:
    assert shorten_middle(["eu-west-long-region-name-0", "us-east-0"], 9) == ["eu…name-0", "us-east-0"]
    assert shorten_middle(["eu-west-long-region-name-0"], 14) == ["eu-w…on-name-0"]  # 14 wide


def test_shortened_names_stay_distinct() -> None:
    names = ["region-a-very-long-x-0", "region-b-very-long-x-0"]  # they differ only near the start
    short = shorten_middle(names, 9)
    assert len(set(short)) == 2 and all(len(s) <= len(n) for s, n in zip(short, names, strict=True))
    pair = ["a-long-learner-name-for-east-0", "a-long-learner-name-for-east-1"]
    assert shorten_middle(pair, 9) == ["a-…east-0", "a-…east-1"]


def test_never_below_the_minimum() -> None:
    assert all(len(s) >= MIN_NAME_CHARS for s in shorten_middle(["x" * 30 + "-0", "y" * 30 + "-1"], 2))


def test_prefects_log_goes_to_the_log_file_while_the_table_is_live(tmp_path, monkeypatch, capsys) -> None:
    """Prefect's console handler, made (on Prefect's import) while the table is live, prints with a rich
    Console of its own, which wrote around the Live's redirection into the table; now its lines go to the
    run's log file, and to the terminal again once the table is gone."""
    import io
    import logging
    import sys
    from types import SimpleNamespace

    from prefect.logging.handlers import PrefectConsoleHandler
    from rich.console import Console
    from rich.table import Table

    from diloco.cli import view

    monkeypatch.setattr(view, "progress_table", lambda *a, **k: Table(title="the live table"))
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=80)
    logger = logging.getLogger("test.prefect.console")
    logger.propagate = False
    log_path = tmp_path / "logs" / "supervisor.log"
    with view.LiveView(SimpleNamespace(run_id="r"), console, True, log_path):
        # as Prefect's dictConfig makes it: ext://sys.stderr
        handler = PrefectConsoleHandler(stream=sys.stderr)
        logger.addHandler(handler)
        logger.warning("Beginning flow run 'train-r'")
    try:
        assert "Beginning flow run" in log_path.read_text()
        assert "Beginning flow run" not in screen.getvalue() + capsys.readouterr().err
        assert f"{log_path} (1 lines)" in screen.getvalue()
        logger.warning("Finished in state Completed()")
        assert "Finished in state" in capsys.readouterr().err and "Finished" not in log_path.read_text()
    finally:
        logger.removeHandler(handler)

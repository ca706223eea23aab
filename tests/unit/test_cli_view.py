"""`diloco status` at narrow widths: a name too long for the table is shortened from the middle, keeping its
start and its distinguishing suffix, and never so far that two learners read the same.

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

"""The demo's figures are stated by its recipe (diloco/configs/demo.yaml): README's token budget and learner
count agree with it, and `diloco run --help` restates no number of its own (it names the recipe's key
instead).

Run: .venv/bin/pytest tests/unit/test_demo_figures.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from diloco.cli import app
from diloco.configs import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_readme_states_the_recipes_budget_and_learners() -> None:
    demo, readme = load_config("demo").run, (ROOT / "README.md").read_text()
    budgets = re.findall(r"carry ([0-9.]+)M tokens", readme)
    assert budgets == [f"{demo.num_tokens / 1e6:.1f}"], budgets
    assert f"trains the demo model: {demo.num_learners} learners" in readme


def test_run_help_restates_no_budget() -> None:
    text = CliRunner().invoke(app, ["run", "--help"], terminal_width=200).output
    assert "run.num_tokens" in text and not re.search(r"\d,\d{3},\d{3}|\d\.\dM", text), text

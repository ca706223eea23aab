"""The README's "Train your own model" example runs as written: the code block in README.md is
examples/my_model.py, and running it in an empty folder trains two learners whose held-out loss falls.

Run: .venv/bin/pytest tests/e2e/test_readme_example.py   (about 30 s on 2 cores)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Train your own model", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_block_is_the_example_file() -> None:
    assert readme_example() == (ROOT / "examples" / "my_model.py").read_text()


def test_the_example_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "my_model.py"
    script.write_text(readme_example())
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = map(float, re.search(r"held-out ([\d.]+) -> ([\d.]+)", done.stdout).groups())
    assert after < before - 0.5, done.stdout
    assert (tmp_path / "runs").is_dir()

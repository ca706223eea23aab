"""`make test` names its test folders explicitly (for ordering); this keeps that list complete,
so a new folder of tests can never be skipped silently.
Run: .venv/bin/pytest tests/unit/test_suite_layout.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_folder_is_in_make_test():
    makefile = (ROOT / "Makefile").read_text()
    order = re.search(r"^TEST_ORDER\s*:=\s*(.+)$", makefile, re.M)
    assert order, "Makefile lacks TEST_ORDER"
    listed = {Path(p).name for p in order.group(1).split()}
    folders = {p.parent.name for p in (ROOT / "tests").glob("*/test_*.py")}
    assert folders <= listed, f"test folders missing from TEST_ORDER: {sorted(folders - listed)}"

"""`diloco remove-learner` on a local run (processes forked from the zygote, no Prefect): the learner ends
after its phase, stays ended, and the run goes on. The Prefect path: tests/deployment/test_deployments.py.

Run: .venv/bin/pytest -m chaos tests/chaos/test_remove_learner.py   (about 40 s on 2 cores)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chaos_harness import assert_no_children
from removal import check_removal

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def test_a_removed_learner_ends_and_stays_ended(tmp_path: Path) -> None:
    check_removal(tmp_path, prefect=False, env={"DILOCO_LOCAL_DIR": str(tmp_path / "local")})
    assert_no_children()

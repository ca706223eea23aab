"""What every task shares: artifact keys.

Contract: tasks never retry — storage requests retry transient errors in the store (one layer per request)
and a learner's join rides out longer outages in its own loop; a third layer here would multiply the waits.
"""

from __future__ import annotations

import re


def artifact_key(kind: str, run_id: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]", "-", f"{kind}-{run_id}".lower())[:100]

"""What every task shares: retry only on errors known to be transient, and artifact keys.

Contract: a bug is never retried; only TransientError (throttling, 5xx, timeouts) is.
"""

from __future__ import annotations

import re

from diloco.storage import TransientError


def retry_on_transient(task, task_run, state) -> bool:  # noqa: ARG001 - Prefect's signature
    try:
        state.result()
    except TransientError:
        return True
    except Exception:  # noqa: BLE001 - anything else is a bug or a permanent error: no retry
        return False
    return False


def artifact_key(kind: str, run_id: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]", "-", f"{kind}-{run_id}".lower())[:100]

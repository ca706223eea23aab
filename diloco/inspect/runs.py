"""Every run in a storage URL, with where it stands: id, state, versions, last held-out loss, learners, and
its traffic: bytes sent and received per learner counting every object, and their ratios to data-parallel;
and the bytes it holds in the bucket (one listing with sizes per run).

Contract: read-only; a run is a top-level folder with a run.json; one that cannot be read is listed with
its problem rather than dropped; a run whose traffic cannot be read is listed without it.
"""

from __future__ import annotations

from typing import Any

from diloco.evaluator.evaluator import read_evals
from diloco.inspect.summary import traffic_figures
from diloco.run.context import RunError, open_run
from diloco.run.state import read_run_state
from diloco.storage import StorageError
from diloco.storage.store import Store


def run_ids(store: Store) -> list[str]:
    """Ids of the runs in the store (folders holding a run.json), sorted."""
    return sorted({key.split("/")[0] for key in store.list("")
                   if key.count("/") == 1 and key.endswith("/run.json")})


def bucket_bytes(store: Store, run_id: str) -> int:
    """Every byte the run holds in the bucket: one listing of its keys with their sizes (no HEAD per key)."""
    return sum(store.sizes(f"{run_id}/").values())


def list_runs(store: Store) -> list[dict[str, Any]]:
    rows = []
    for run_id in run_ids(store):
        try:
            ctx = open_run(store, run_id)
            state = read_run_state(ctx)
            evals = read_evals(ctx)
        except (RunError, StorageError) as err:
            rows.append({"run_id": run_id, "state": "unreadable", "problem": str(err)})
            continue
        last = evals[-1] if evals else None
        try:
            traffic = traffic_figures(ctx)
        except (RunError, StorageError, ValueError):
            traffic = {}
        traffic.pop("bytes_by_kind", None)
        rows.append({**traffic, "run_id": run_id, "state": state.word, "reason": state.reason,
                     "version": state.version,
                     "target": state.target, "tokens": state.tokens, "token_budget": state.budget,
                     "last_eval_loss": last["loss"] if last else None,
                     "last_eval_version": last["version"] if last else None,
                     "num_learners": len(ctx.learners), "created_at": ctx.created_at, "recipe": ctx.cfg.name,
                     "bucket_bytes": bucket_bytes(store, run_id)})
    return rows

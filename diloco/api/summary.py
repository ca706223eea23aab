"""What `diloco.train()` returns and `diloco run --json` prints last: a RunSummary, the main figures of a run
and the rest under `extra`, every one read back from the bucket (diloco.inspect.report.summary_json builds
it).

Contract: a TypedDict — a plain dict at run time, so `summary["final_eval_loss"]` and `json.dumps(summary)`
work as they always did; it names every key a summary has (tests/integration/test_summary.py checks them
against a real run's); a figure nobody measured is None, never invented.
"""

from __future__ import annotations

from typing import Any, TypedDict

# the functional form: `continue` is a Python keyword
RunSummaryExtra = TypedDict("RunSummaryExtra", {
    "final_eval_version": int | None,  # the version final_eval_loss was measured on
    "metric": str,  # the held-out loss's unit ("nats/byte" for the built-in specs)
    "dp_bytes_equivalent": int,  # what ring all-reduce data-parallel would have sent for the merged steps
    "tokens_merged": int,
    "num_params": int,
    "rejections": list[str],  # the kinds of reasons deltas were rejected for
    "deltas_pending": int,  # published after the last merge
    "bytes_pending": int,
    "bytes_sent": int | None,  # every byte the learners sent (None: nothing counted)
    "bytes_received": int | None,
    "traffic_ratio_vs_dp": float | None,  # dp_bytes_equivalent / bytes_sent
    "received_ratio_vs_dp": float | None,  # dp_bytes_equivalent / bytes_received
    "delta_traffic_ratio_vs_dp": float | None,  # dp_bytes_equivalent / the deltas' bytes alone
    "state": str,  # running, finished, stopped or idle (diloco.run.state)
    "state_title": str,
    "stop_reason": str | None,
    "continue": str | None,  # the command that continues an ended run
    "learners": list[dict[str, Any]],  # a row per learner: deltas, bytes sent and received, busy, ...
    "time_limit_s": float,
    "target": str,  # `50 versions` or `6,000,000 tokens (at most 400 versions)`
    "ended_by": str | None,  # target, time limit, stop, interrupted, terminated, learners crashed, error
    "short_of_target": bool | None,
    "failed_learners": list[dict[str, Any]],
    "failure": str | None,  # why the run failed (diloco.inspect.outcome), None when it did not
})


class RunSummary(TypedDict):
    """A run's summary: the keys `diloco run --json` has always printed first, the rest under `extra`."""

    run_id: str
    storage: str
    num_versions: int
    num_learners: int
    initial_eval_loss: float | None
    final_eval_loss: float | None
    deltas_merged: int
    deltas_rejected: int
    bytes_published: int
    extra: RunSummaryExtra

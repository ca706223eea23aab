"""Evaluation task: held-out loss of the next due version, and the loss table artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from diloco.evaluator.evaluator import Evaluator, read_evals
from diloco.tasks.common import artifact_key


@task(name="evaluate", cache_policy=NO_CACHE, task_run_name="evaluate-v{version}")
def evaluate_task(evaluator: Evaluator, version: int) -> dict:
    record = evaluator.evaluate_version(version)
    if record is not None:
        rows = [{"version": r["version"], "held_out": round(r["loss"], 4),
                 "metric": r.get("metric", "nats/byte"),
                 "bits_per_byte": None if r.get("bits_per_byte") is None else round(r["bits_per_byte"], 4),
                 "tokens": r.get("tokens_total", 0)}
                for r in read_evals(evaluator.ctx)]
        create_table_artifact(rows, key=artifact_key("loss", evaluator.ctx.run_id),
                              description=f"run {evaluator.ctx.run_id}: held-out loss per version")
    return record

"""Flow `outer-merge`: the long-running merger; a task (and a table artifact) per merge."""

from __future__ import annotations

from prefect import flow

from diloco.run.loops import StopSignal
from diloco.merger.merger import run_merger
from diloco.launch import make_merger
from diloco.supervise.deployments import export_aws_credentials
from diloco.tasks.merge import merge_task


@flow(name="outer-merge", flow_run_name="merge-{run_id}", persist_result=False)
def outer_merge_flow(storage: str, run_id: str, merges: int | None = None, merger_id: str = "merger",
                     aws_credentials_block: str | None = None) -> int:
    """Merge until the run's target version is committed or the run is stopped."""
    if aws_credentials_block:
        export_aws_credentials(aws_credentials_block)
    merger, ctx = make_merger(storage, run_id, merger_id)
    return run_merger(merger, max_merges=merges, target_version=ctx.cfg.run.num_versions,
                      should_stop=StopSignal(ctx), merge=merge_task)

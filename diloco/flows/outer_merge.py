"""Flow `outer-merge`: the long-running merger of its chains (the whole model's, or a shard's fragments); a
task (and a table artifact) per merge of any chain."""

from __future__ import annotations

from prefect import flow

from diloco.flows.credentials import export_aws_credentials
from diloco.launch import Units, run_role
from diloco.tasks.merge import merge_task


@flow(name="outer-merge", flow_run_name="merge-{run_id}", persist_result=False)
def outer_merge_flow(storage: str, run_id: str, merges: int | None = None, merger_id: str = "merger",
                     aws_credentials_block: str | None = None) -> int:
    """Merge until the run's target version is committed or the run is stopped."""
    if aws_credentials_block:
        export_aws_credentials(aws_credentials_block)
    return run_role("merger", storage, run_id, merger_id, merges=merges, units=Units(merge=merge_task))

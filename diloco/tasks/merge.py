"""Merge task: one outer step of one chain (the root's, or a fragment's), and its table artifact (who was
merged, weights, staleness, bytes). The merger's loop calls it once the chain is due: a task per merge, never
per poll."""

from __future__ import annotations

from collections.abc import Callable

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from diloco.merger.merger import Merger
from diloco.storage import Manifest


def merge_table(manifest: Manifest) -> list[dict]:
    rows = []
    for d in manifest.decisions:
        rows.append({
            "learner": d.learner, "seq": d.seq, "status": d.status, "weight": round(d.weight, 4),
            "staleness": d.staleness, "base_version": d.base_version, "tokens": d.tokens, "bytes": d.bytes,
            "check": d.check, "norm": None if d.norm is None else round(d.norm, 6), "reason": d.reason,
        })
    timing = manifest.timing
    rows.append({"learner": "(merge)", "seq": manifest.version, "status": "committed", "weight": 1.0,
                 "staleness": 0, "base_version": manifest.parent, "tokens": manifest.tokens_total,
                 "bytes": int(manifest.stats.get("update_bytes", 0)),
                 "reason": f"wait {timing.get('quorum_wait_s', 0):.2f}s grace "
                           f"{timing.get('grace_s', 0):.2f}s merge {timing.get('merge_s', 0):.3f}s"})
    rows.append(trust_row(manifest))
    return rows


def trust_row(manifest: Manifest) -> dict:
    """The guard after this merge: quarantined learners, the outlier bound, pause, the ops this merge
    applied."""
    guard, stats = manifest.guard, manifest.stats
    quarantined = ", ".join(f"{k} ({v})" for k, v in guard.quarantined.items()) if guard else ""
    bound = stats.get("outlier_bound")
    ops = "; ".join(f"{e.kind}{' ' + e.learner if e.learner else ''} by {e.by}"
                    + (f" REFUSED: {e.refused}" if e.refused else "")
                    for e in manifest.controls)
    return {"learner": "(trust)", "seq": manifest.version,
            "status": "paused" if guard and guard.paused else "guarded",
            "weight": 0.0, "staleness": 0, "base_version": manifest.parent, "tokens": 0, "bytes": 0,
            "check": "", "norm": None if bound is None else round(bound, 6),
            "reason": f"quarantined: {quarantined or 'none'}; outlier bound (norm/step) "
                      f"{'warming up' if bound is None else f'{bound:.3g}'}"
                      + (f"; controls: {ops}" if ops else "")}


@task(name="merge", cache_policy=NO_CACHE)
def merge_task(merger: Merger, should_stop: Callable[[], bool]) -> Manifest | None:
    manifest = merger.merge_once(should_stop)
    if manifest is not None:
        from diloco.tasks.common import artifact_key

        fragment = merger.ctx.keys.fragment
        create_table_artifact(
            merge_table(manifest), key=artifact_key("merge", merger.ctx.run_id),
            description=f"run {merger.ctx.run_id}{'' if fragment is None else f' fragment {fragment}'}: "
                        f"version {manifest.version}, "
                        f"{len(manifest.merged())} merged, {len(manifest.rejected())} rejected",
        )
    return manifest

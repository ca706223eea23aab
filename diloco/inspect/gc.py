"""Orphan collection: objects under global/ that no manifest references, left by a merger that
crashed (or lost a commit race) after writing them and before its manifest.

Contract: only unreferenced objects older than `min_age_s` are deleted — a live merger's objects
for the version it is about to commit are younger than that — and the run's history is intact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from diloco.run.context import RunContext
from diloco.run.fragments import fragment_context, manifests
from diloco.storage import NotFound, StorageError

DEFAULT_MIN_AGE_S = 600.0  # far longer than any merge takes to go from its first object to its manifest


@dataclass
class GcReport:
    referenced: int = 0
    orphans: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    too_young: list[str] = field(default_factory=list)


def collect_orphans(ctx: RunContext, *, min_age_s: float = DEFAULT_MIN_AGE_S, dry_run: bool = False,
                    now: float | None = None) -> GcReport:
    """The orphans of the run's chain, or of every chain of a fragmented run (the root's and each fragment's)."""
    report = _collect_chain(ctx, GcReport(), min_age_s, dry_run, now)  # the root chain (reads keys, not fragments)
    for index in range(len(ctx.fragments)):
        report = _collect_chain(fragment_context(ctx, index), report, min_age_s, dry_run, now)
    return report


def _collect_chain(ctx: RunContext, report: GcReport, min_age_s: float, dry_run: bool, now: float | None) -> GcReport:
    referenced = set()
    for m in manifests(ctx):
        referenced.update(k for k in (m.params_key, m.update_key, m.outer_key, m.buffers_key) if k)
    report.referenced += len(referenced)
    now = time.time() if now is None else now
    for key in ctx.store.list(ctx.keys.global_prefix()):
        if key in referenced:
            continue
        report.orphans.append(key)
        try:
            age = now - ctx.store.modified(key)
        except (NotFound, StorageError):
            continue
        if age < min_age_s:
            report.too_young.append(key)
        elif not dry_run:
            ctx.store.delete(key)
            report.deleted.append(key)
    return report

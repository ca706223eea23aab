"""The outlier statistic over a finished run: every merged delta's norm per step against the running median
of the merged deltas before it, as the merge's rule sees it — to set and check `merger.outlier_threshold`.

Contract: read-only; uses the norms manifests record (runs since the guard) or, for older runs, reads each
merged delta once; the window is the merger's: the norms merged up to the previous version, oldest first,
the last `window` of them, the rule silent below `min_samples`; deltas the rule rejected or clipped are
listed (flagged) but never enter the window.
"""

from __future__ import annotations

import statistics
from typing import Any

from diloco.run.context import RunContext
from diloco.run.fragments import manifests
from diloco.run.objects import read_tensors
from diloco.storage import DeltaDecision, Manifest
from diloco.storage.window import with_window
from diloco.trust.judge import delta_norm


def _manifests(ctx: RunContext) -> list[Manifest]:
    """The chain's manifests with their windows (each decision's norm and clip: the merger's own figures)."""
    return [with_window(ctx.store, ctx.keys, m) for m in manifests(ctx)]


def _norm(ctx: RunContext, d: DeltaDecision) -> float:
    if d.norm is not None:
        return d.norm
    _, delta = read_tensors(ctx.store, ctx.keys.delta(d.learner, d.seq), checksum=d.checksum)
    return delta_norm(delta)


def _median(window: list[float], size: int, min_samples: int) -> float | None:
    norms = window[-size:]
    return statistics.median(norms) if len(norms) >= min_samples else None


def ratios(ctx: RunContext, window: int | None = None,
           min_samples: int | None = None) -> list[dict[str, Any]]:
    """One row per merged (or outlier-judged) delta: version, learner, seq, steps, norm, per_step, median,
    ratio."""
    size = window or ctx.cfg.merger.outlier_window
    least = min_samples or ctx.cfg.merger.outlier_min_samples
    seen: list[float] = []
    rows: list[dict[str, Any]] = []
    for m in _manifests(ctx):
        median = _median(seen, size, least)
        merged_now: list[float] = []
        for d in m.decisions:
            judged = d.status == "merged" or d.check == "outlier"
            if not judged or d.steps <= 0:
                continue
            per_step = _norm(ctx, d) / d.steps
            rows.append({"version": m.version, "learner": d.learner, "seq": d.seq, "steps": d.steps,
                         "staleness": d.staleness, "per_step": per_step, "median": median,
                         "ratio": None if not median else per_step / median,
                         "outlier": d.check == "outlier", "status": d.status})
            if d.status == "merged" and d.clip_scale is None:
                merged_now.append(per_step)
        seen = (seen + merged_now)[-max(size, 1):]
    return rows


def summarize(rows: list[dict[str, Any]],
              thresholds: tuple[float, ...] = (3, 5, 10, 20, 50)) -> dict[str, Any]:
    """The distribution of the ratios of the honest (not outlier-flagged) deltas, and what each threshold
    would have rejected."""
    honest = sorted(r["ratio"] for r in rows if r["ratio"] is not None and not r["outlier"])

    def quantile(q: float) -> float | None:
        return honest[min(len(honest) - 1, int(q * len(honest)))] if honest else None

    top = sorted((r for r in rows if r["ratio"] is not None), key=lambda r: -r["ratio"])[:5]
    return {"deltas": len(rows), "judged": len(honest), "flagged_outlier": sum(r["outlier"] for r in rows),
            "max_ratio": honest[-1] if honest else None, "p99_ratio": quantile(0.99),
            "p95_ratio": quantile(0.95), "median_ratio": quantile(0.5),
            "min_ratio": honest[0] if honest else None,
            "would_reject": {f"{t:g}x": sum(1 for x in honest if x > t) for t in thresholds},
            "top": [{k: r[k] for k in ("version", "learner", "seq", "steps", "staleness", "ratio")}
                    for r in top]}


GUARD_CHECKS = ("admission", "quarantine", "signature", "outlier")


def guard_figures(ctx: RunContext, honest: list[str] | None = None) -> dict[str, Any]:
    """What the guard did to the run's own learners (`honest`, default run.json's): rejections and clips by
    the trust rules (a false rejection when these learners are honest), and the honest ratio distribution."""
    names = set(ctx.learners if honest is None else honest)
    chain = _manifests(ctx)
    guarded = [d for m in chain for d in m.decisions if d.learner in names
               and (d.check in GUARD_CHECKS or d.clip_scale is not None)]
    rows = [r for r in ratios(ctx) if r["learner"] in names]
    summary = summarize(rows)
    return {"guard_rejections": sum(1 for d in guarded if d.status == "rejected"),
            "guard_clips": sum(1 for d in guarded if d.clip_scale is not None),
            "guard_reasons": sorted({d.reason.split(":")[0] for d in guarded}),
            "judged": summary["judged"], "max_ratio": summary["max_ratio"], "p99_ratio": summary["p99_ratio"],
            "median_ratio": summary["median_ratio"], "top": summary["top"][:3]}

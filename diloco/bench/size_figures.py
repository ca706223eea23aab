"""The figures of one `diloco bench size` row, read back from the run's bucket (and the watcher's peaks).

Contract: read-only; per parameter where the issue asks it (peak memory, bucket growth); every learner byte
counted (the summary's traffic by kind); a figure that cannot be measured is None, never guessed.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from diloco.inspect.audit import audit_run
from diloco.inspect.summary import build_summary
from diloco.run.context import open_run
from diloco.run.events import read_events
from diloco.run.fragments import fragment_context, manifests, num_fragments
from diloco.storage import StorageError, read_manifest


def figures(storage: str, run_id: str, peaks: dict[int, int], wall_s: float) -> dict[str, Any]:
    ctx = open_run(storage, run_id)
    summary = build_summary(ctx)
    events = read_events(ctx.store, ctx.keys)
    n = summary["num_params"]
    roles = {int(e["pid"]): (e.get("role"), e.get("learner")) for e in events
             if e.get("kind") == "start" and e.get("source") == "supervisor" and e.get("pid")}
    versions = max(1, summary["num_versions"])
    memory = _memory(events, peaks, roles, n)
    traffic = _traffic(summary, events)
    rejoin = _rejoin(ctx, events)
    merge_s = sum(float(e.get("merge_s", 0.0)) for e in events if e.get("kind") == "merge"
                  and str(e.get("source", "")).startswith("merger"))
    initial, final = summary["initial_eval_loss"], summary["final_eval_loss"]
    return {
        "model_params": n, "versions": summary["num_versions"], "tokens_merged": summary["tokens_merged"],
        "tokens_per_s": summary["tokens_merged"] / wall_s if wall_s else None,
        "initial_eval_loss": initial, "final_eval_loss": final,
        "loss_drop": None if initial is None or final is None else initial - final,
        **memory, **traffic, **_bucket(ctx, storage, n, versions),
        "merge_s_per_round": merge_s / versions, **rejoin,
        "deltas_merged": summary["deltas_merged"], "deltas_rejected": summary["deltas_rejected"],
        "audit_ok": audit_run(ctx).ok, "state": summary["state"],
        **{k: summary[k] for k in ("traffic_ratio_vs_dp", "received_ratio_vs_dp",
                                   "delta_traffic_ratio_vs_dp")},
    }


def _per(value: float | None, n: int) -> float | None:
    return None if value is None else value / n


def _memory(events: list[dict], peaks: dict[int, int], roles: dict[int, tuple], n: int) -> dict[str, Any]:
    """Peak resident memory per parameter: every learner process (the watcher's marks and the learners' own,
    the larger), beyond its baseline (its RSS before the model was built), the merger's; CUDA's device
    peak."""
    learner_peak: dict[int, int] = defaultdict(int)
    baseline: dict[int, int] = {}
    device = 0
    for e in events:
        if e.get("kind") in ("phase", "join") and e.get("learner") and e.get("peak_rss_bytes"):
            pid = int(e.get("pid", 0))
            learner_peak[pid] = max(learner_peak[pid], int(e["peak_rss_bytes"]))
            if e.get("baseline_rss_bytes"):
                baseline[pid] = int(e["baseline_rss_bytes"])
            device = max(device, int(e.get("device_peak_bytes", 0)))
    for pid, peak in peaks.items():
        if roles.get(pid, (None,))[0] == "learner":
            learner_peak[pid] = max(learner_peak[pid], peak)
    merger = [peak for pid, peak in peaks.items() if roles.get(pid, (None,))[0] == "merger"]
    evaluator = [peak for pid, peak in peaks.items() if roles.get(pid, (None,))[0] == "evaluator"]
    beyond = [learner_peak[pid] - baseline[pid] for pid in learner_peak if pid in baseline]
    return {"learner_peak_rss_bytes_per_param": _per(max(learner_peak.values(), default=None), n),
            "learner_peak_rss_beyond_baseline_bytes_per_param": _per(max(beyond, default=None), n),
            "learner_baseline_rss_bytes": max(baseline.values(), default=None),
            "merger_peak_rss_bytes_per_param": _per(max(merger, default=None), n),
            "evaluator_peak_rss_bytes_per_param": _per(max(evaluator, default=None), n),
            "device_peak_bytes_per_param": _per(device or None, n),
            "learner_processes": len(learner_peak)}


def _traffic(summary: dict[str, Any], events: list[dict]) -> dict[str, Any]:
    """What the learners uploaded per phase (every object) against their deltas per phase, and by kind."""
    phases = sum(1 for e in events if e.get("kind") == "phase" and e.get("learner"))
    sent: dict[str, int] = defaultdict(int)
    received: dict[str, int] = defaultdict(int)
    for row in summary["learners"]:
        for kind, value in (row.get("sent_by_kind") or {}).items():
            sent[kind] += value
        for kind, value in (row.get("received_by_kind") or {}).items():
            received[kind] += value
    upload, delta = sum(sent.values()), sent.get("delta", 0)
    return {"learner_upload_bytes_per_phase": upload / phases if phases else None,
            "delta_bytes_per_phase": delta / phases if phases else None,
            "learner_upload_mb_per_phase": upload / phases / 1e6 if phases else None,
            "delta_mb_per_phase": delta / phases / 1e6 if phases else None,
            "upload_over_delta": upload / delta if delta else None, "phases": phases,
            "learner_sent_by_kind": dict(sent), "learner_received_by_kind": dict(received)}


def _bucket(ctx, storage: str, n: int, versions: int) -> dict[str, Any]:
    """The run's bytes in the bucket per parameter per version (version 0's objects left out), by top
    folder."""
    if not storage.startswith("file://"):
        return {"bucket_bytes_per_param_per_version": None}
    base = storage.removeprefix("file://")
    root = os.path.join(base, ctx.run_id)
    initial: list[str] = []  # version 0's objects (paths, or a checkpoint's folder), of every chain
    chains = [ctx.keys]
    if ctx.fragments:
        chains += [fragment_context(ctx, i).keys for i in range(num_fragments(ctx))]
    for keys in chains:  # the root chain's version 0, and every fragment chain's
        try:
            m0 = read_manifest(ctx.store, keys, 0)
        except StorageError:
            continue
        initial += [os.path.join(base, k) for k in (m0.params_key, m0.buffers_key) if k]
        if m0.checkpoint is not None:
            initial.append(os.path.join(base, os.path.dirname(m0.checkpoint.key)) + os.sep)
    by_folder: dict[str, int] = defaultdict(int)
    for folder, _, files in os.walk(root):
        top = os.path.relpath(folder, root).split(os.sep)[0]
        for name in files:
            path = os.path.join(folder, name)
            if not any(path == i or (i.endswith(os.sep) and path.startswith(i)) for i in initial):
                by_folder[top if top != "." else "run"] += os.path.getsize(path)
    total = sum(by_folder.values())
    return {"bucket_bytes_per_param_per_version": total / n / versions,
            "bucket_bytes_by_folder": dict(by_folder)}


def _rejoin(ctx, events: list[dict]) -> dict[str, Any]:
    """The killed learner: seconds from its restarted process's start to its join (rejoin_s), from the kill to
    the join, and whether a delta it shipped after the join was merged (it contributes again)."""
    kills = [e for e in events if e.get("kind") == "fault" and e.get("fault") == "kill_learner"]
    if not kills:
        return {"rejoin_s": None, "kill_to_join_s": None, "rejoined_contributed": False}
    kill = min(kills, key=lambda e: e["t"])
    name = kill.get("learner")
    start = min((e["t"] for e in events if e.get("kind") == "start" and e.get("source") == "supervisor"
                 and e.get("learner") == name and e["t"] >= kill["t"]), default=None)
    join = min((e for e in events if e.get("kind") == "join" and e.get("learner") == name
                and start is not None and e["t"] >= start), key=lambda e: e["t"], default=None)
    contributed = False
    if join is not None:
        seqs = join.get("seqs") or [join.get("seq", 0)] * num_fragments(ctx)
        for index in range(num_fragments(ctx)):
            first = seqs[index] if index < len(seqs) else 0
            chain = manifests(fragment_context(ctx, index))
            contributed |= any(d.learner == name and d.seq >= first for m in chain for d in m.merged())
    return {"rejoin_s": None if join is None or start is None else join["t"] - start,
            "kill_to_join_s": None if join is None else join["t"] - kill["t"], "rejoined_learner": name,
            "rejoined_from_local_state": bool(join and join.get("local")),
            "rejoined_contributed": contributed}

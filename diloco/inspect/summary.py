"""A run's complete summary: held-out loss of version 0 and of the final version, where the run stands, and
the traffic of every learner — deltas sent (merged, rejected, pending), bytes received — against
data-parallel, and how busy each learner was (its inner steps over its wall time).

Contract: every figure comes from the bucket (manifests, deltas listed, evals, the learners' `traffic`
events); the version 0 and final version the evaluator did not reach are scored first (evaluator/evaluator.py
evaluate_missing), so no summary says "version None"; rendering is plain text
rows and markdown (the `train` flow's artifact), so the CLI and Prefect show the same thing.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from diloco.inspect.outcome import failure_cells, run_outcome
from diloco.inspect.report import (
    dp_bytes,
    fragment_chains,
    learner_status,
    nats_to_bits,
    summarize,
)
from diloco.run.context import RunContext
from diloco.run.events import read_events
from diloco.run.fragments import manifests
from diloco.run.state import continue_hint, read_run_state
from diloco.run.target import run_target
from diloco.storage import Manifest, StorageError, parse_delta_key

log = logging.getLogger("diloco.summary")


def pending_deltas(ctx: RunContext, chain: list[Manifest]) -> dict[str, list[tuple[int, int]]]:
    """learner -> [(seq, bytes)] of the deltas in the bucket that no manifest decided (published after the
    last merge, or waiting for the next one)."""
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for keys, decided in _chains_decided(ctx, chain):
        for key in ctx.store.list(keys.deltas_prefix()):
            parsed = parse_delta_key(key)
            if parsed is None or parsed in decided:
                continue
            try:
                out[parsed[0]].append((parsed[1], ctx.store.get_size(key)))
            except StorageError:
                continue
    return dict(out)


def _chains_decided(ctx: RunContext, chain: list[Manifest]):
    """(keys, decided (learner, seq)) per chain: the root's, or every fragment's."""
    if not ctx.fragments:
        return [(ctx.keys, {(d.learner, d.seq) for m in chain for d in m.decisions})]
    return [(ctx.keys.for_fragment(p), {(d.learner, d.seq) for m in c for d in m.decisions})
            for p, c in enumerate(fragment_chains(ctx))]


Traffic = dict[str, dict[str, dict[str, int]]]  # learner -> sent/received -> kind -> bytes


def learner_traffic_by_kind(ctx: RunContext, events: list[dict[str, Any]] | None = None) -> Traffic:
    """learner -> {"sent": {kind: bytes}, "received": {kind: bytes}}: what each of its processes put and got,
    by object kind (diloco.storage.traffic: delta, checkpoint, status, event, manifest, global, listing, ...;
    the last `traffic` event of each process: counters are per process), summed over its processes."""
    last: dict[tuple[str, int, str], dict[str, Any]] = {}
    for event in read_events(ctx.store, ctx.keys) if events is None else events:
        if event.get("kind") == "traffic" and event.get("learner"):
            last[(event["learner"], int(event.get("pid", 0)), str(event.get("counters", "")))] = event
    out: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: {"sent": defaultdict(int),
                                                                     "received": defaultdict(int)})
    for (name, _pid, _counters), event in last.items():
        for way in ("sent", "received"):
            for kind, value in (event.get(way) or {}).items():
                out[name][way][kind] += int(value)
    return {name: {way: dict(kinds) for way, kinds in ways.items()} for name, ways in out.items()}


def totals(by_kind: Traffic) -> dict[str, dict[str, int]]:
    """learner -> {"sent", "received"}: all bytes each learner's processes put and got, every kind summed."""
    return {name: {way: sum(kinds.values()) for way, kinds in ways.items()} for name, ways in by_kind.items()}


def traffic_figures(ctx: RunContext, events: list[dict[str, Any]] | None = None,
                    base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's traffic against data-parallel in one place (`diloco runs`, bench goodput, bench size): bytes
    sent and received per learner counting every object the learners' processes moved (and listings' keys),
    the ratios to data-parallel of those totals, and beside them, labelled, the deltas-only ratio. None where
    nothing was counted."""
    base = base or summarize(ctx)
    by_kind = learner_traffic_by_kind(ctx, events)
    per_learner = totals(by_kind).values()
    sent = [ways["sent"] for ways in per_learner]
    received = [ways["received"] for ways in per_learner]
    m = max(1, len(ctx.learners))
    dp_total = base["dp_bytes_equivalent"]
    kinds: dict[str, dict[str, int]] = {"sent": defaultdict(int), "received": defaultdict(int)}
    for ways in by_kind.values():
        for way in kinds:
            for kind, value in ways[way].items():
                kinds[way][kind] += value
    return {"bytes_sent_per_learner": sum(sent) / m if sent else None,
            "bytes_received_per_learner": sum(received) / m if received else None,
            "traffic_ratio_vs_dp": _ratio(dp_total, sent), "received_ratio_vs_dp": _ratio(dp_total, received),
            "delta_traffic_ratio_vs_dp": base["delta_traffic_ratio_vs_dp"],
            "dp_bytes_each_way_per_learner": dp_total / m,
            "bytes_by_kind": {way: dict(v) for way, v in kinds.items()}}


def learner_busy(events: list[dict[str, Any]]) -> dict[str, float]:
    """learner -> how busy it was: its time in inner steps (the phase events' compute_s) over the wall time
    from each of its processes' first phase start to its last phase end. Learners whose events carry no
    compute_s (older runs) are left out."""
    compute: dict[str, float] = defaultdict(float)
    spans: dict[tuple[str, int], list[float]] = {}
    for event in events:
        if event.get("kind") != "phase" or not event.get("learner") or "compute_s" not in event:
            continue
        try:
            start, end = float(event["t_start"]), float(event["t_start"]) + float(event["duration_s"])
            compute[event["learner"]] += float(event["compute_s"])
        except (KeyError, TypeError, ValueError):
            continue
        span = spans.setdefault((event["learner"], int(event.get("pid", 0))), [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
    wall: dict[str, float] = defaultdict(float)
    for (name, _pid), (start, end) in spans.items():
        wall[name] += end - start
    return {name: compute[name] / wall[name] for name in compute if wall[name] > 0}


def _learner_rows(ctx: RunContext, chain: list[Manifest], pending: dict[str, list[tuple[int, int]]],
                  num_params: int, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_kind, busy = learner_traffic_by_kind(ctx, events), learner_busy(events)
    traffic = totals(by_kind)
    names = sorted({*ctx.learners, *pending, *traffic})
    m = max(1, len(ctx.learners))
    rows = []
    for name in names:
        mine = [d for v in chain for d in v.decisions if d.learner == name]
        merged = [d for d in mine if d.status == "merged"]
        steps = sum(d.steps for d in merged)
        rows.append({
            "learner": name, "deltas_merged": len(merged),
            "deltas_rejected": sum(1 for d in mine if d.status == "rejected"),
            "deltas_pending": len(pending.get(name, [])),
            "delta_bytes": sum(d.bytes for d in mine if d.status != "lost")
            + sum(b for _, b in pending.get(name, [])),
            "bytes_sent": traffic.get(name, {}).get("sent"),
            "bytes_received": traffic.get(name, {}).get("received"),
            "sent_by_kind": by_kind.get(name, {}).get("sent"),
            "received_by_kind": by_kind.get(name, {}).get("received"),
            "steps_merged": steps, "dp_bytes_each_way": int(dp_bytes(num_params, steps, m)),
            "busy": None if name not in busy else round(busy[name], 4),
        })
    return rows


def build_summary(ctx: RunContext) -> dict[str, Any]:
    """summarize()'s figures (the JSON contract of `diloco run --json`) plus the run's state, pending deltas,
    the per-learner traffic (the ratios to data-parallel of every byte the learners sent and received first,
    of the deltas alone beside them) and how the run ended (diloco.inspect.outcome: failed learners,
    failure)."""
    base = summarize(ctx)
    chain = manifests(ctx) if not ctx.fragments else [m for c in fragment_chains(ctx) for m in c]
    pending = pending_deltas(ctx, chain)
    events = read_events(ctx.store, ctx.keys)
    rows = _learner_rows(ctx, chain, pending, base["num_params"], events)
    state = read_run_state(ctx)
    pending_bytes = sum(b for seqs in pending.values() for _, b in seqs)
    published = base["bytes_published"] + pending_bytes
    sent = [r["bytes_sent"] for r in rows if r["bytes_sent"] is not None]
    received = [r["bytes_received"] for r in rows if r["bytes_received"] is not None]
    dp_total = base["dp_bytes_equivalent"]
    return {**base, "bytes_published": published, "deltas_pending": sum(len(s) for s in pending.values()),
            "bytes_pending": pending_bytes, "bytes_sent": sum(sent) if sent else None,
            "bytes_received": sum(received) if received else None,
            "traffic_ratio_vs_dp": _ratio(dp_total, sent), "received_ratio_vs_dp": _ratio(dp_total, received),
            "delta_traffic_ratio_vs_dp": (dp_total / published) if published else None,
            "state": state.word, "state_title": state.title(), "stop_reason": state.reason,
            "continue": continue_hint(ctx) if state.ended else None, "learners": rows,
            "time_limit_s": ctx.cfg.run.time_limit_s, "target": run_target(ctx).describe(),
            **run_outcome(state, learner_status(ctx), events, base["deltas_merged"])}


def _ratio(dp_total: float, measured: list[int]) -> float | None:
    """Data-parallel's bytes over the learners' (every byte they moved one way); None when none was
    counted."""
    return dp_total / sum(measured) if measured and sum(measured) else None


def _fmt_loss(loss: float | None, metric: str = "nats/byte") -> str:
    if loss is None:
        return "not evaluated"
    if metric == "nats/byte":
        return f"{loss:.3f} nats/byte ({nats_to_bits(loss):.3f} bits/byte)"
    return f"{loss:.4f} {metric}"


def _mb(n: int | None) -> str:
    return "—" if n is None else f"{n / 1e6:.2f} MB"


def _vs_dp(ratio: float | None) -> str:
    if ratio is None:
        return "not counted"
    return f"{ratio:.0f}x less" if ratio >= 1 else f"{1 / ratio:.1f}x more"


def traffic_headline(s: dict[str, Any]) -> str:
    """Every byte the learners sent and received against data-parallel, the deltas-only ratio beside it,
    labelled."""
    if s["num_learners"] < 2:
        return "— (data-parallel moves nothing with one learner)"
    if not s["dp_bytes_equivalent"]:
        return "— (no steps merged)"
    return (f"{_vs_dp(s['traffic_ratio_vs_dp'])} sent, {_vs_dp(s['received_ratio_vs_dp'])} received, "
            f"counting every byte (deltas only: {_vs_dp(s['delta_traffic_ratio_vs_dp'])} sent)")


def ending_line(s: dict[str, Any]) -> str | None:
    """The one line a time limit that ended the run short of its target gets (not a failure by itself)."""
    if s.get("ended_by") != "time limit" or not s.get("short_of_target"):
        return None
    return (f"the time limit (run.time_limit_s = {s['time_limit_s']:g} s) ended the run short of its target: "
            f"version {s['num_versions']}, target {s['target']}")


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, value) rows of the summary, in the order a reader wants them: how it ended, the loss, the
    traffic."""
    final = s["final_eval_version"]
    ending = [("run failed", s["failure"])] if s.get("failure") else []
    ending += [("ended by", line)] if (line := ending_line(s)) else []
    return [
        ("run", s["state_title"]),
        *ending,
        ("held-out loss, version 0", _fmt_loss(s["initial_eval_loss"], s["metric"])),
        ("held-out loss, final version" if final is None else f"held-out loss, version {final}",
         _fmt_loss(s["final_eval_loss"], s["metric"])),
        ("versions committed", str(s["num_versions"])),
        ("deltas merged / rejected / pending",
         f"{s['deltas_merged']} / {s['deltas_rejected']} / {s['deltas_pending']}"),
        ("tokens merged", f"{s['tokens_merged']:,}"),
        ("traffic vs data-parallel", traffic_headline(s)),
        ("sent by the learners", f"{_mb(s.get('bytes_sent'))} (of which deltas {_mb(s['bytes_published'])})"),
        ("received by the learners", _mb(s["bytes_received"])),
        ("data-parallel would have sent", f"{s['dp_bytes_equivalent'] / 1e6:.1f} MB each way"),
        *[(f"learner {name}", text) for name, text in failure_cells(s.get("failed_learners", []))],
        ("run lives at", f"{s['storage']}/{s['run_id']}"),
    ]


LEARNER_COLUMNS = ("learner", "merged", "rejected", "pending", "deltas MB", "sent MB", "received MB", "DP MB")


def learner_table_rows(s: dict[str, Any]) -> list[tuple[str, ...]]:
    """Per learner: deltas (merged/rejected/pending), delta MB, all bytes sent and received, DP each way."""
    def mb(n: int | None) -> str:
        return "—" if n is None else f"{n / 1e6:.2f}"

    return [(r["learner"], str(r["deltas_merged"]), str(r["deltas_rejected"]), str(r["deltas_pending"]),
             mb(r["delta_bytes"]), mb(r["bytes_sent"]), mb(r["bytes_received"]), mb(r["dp_bytes_each_way"]))
            for r in s["learners"]]


def summary_markdown(s: dict[str, Any], sample: str | None = None) -> str:
    """The summary as markdown: the `train` flow's artifact."""
    lines = [f"# run {s['run_id']}", "", "| what | value |", "|---|---|"]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in summary_rows(s)]
    lines += ["", "| " + " | ".join(LEARNER_COLUMNS) + " |", "|" + "---|" * len(LEARNER_COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in learner_table_rows(s)]
    lines += ["", "Sent: every byte a learner's processes put (deltas, checkpoints, statuses, events); "
              "received: every byte they got (updates, params, manifests, statuses, listings' keys). "
              "Data-parallel: ring all-reduce "
              "of fp32 gradients, 2(M-1)/M x 4 bytes x params per step, each way, for the steps merged."]
    if s.get("continue"):
        lines += ["", f"`{s['continue'].removeprefix('continue with: ')}` continues it."]
    if sample:
        lines += ["", "## Sampled from the final model", "", "```", sample, "```"]
    return "\n".join(lines) + "\n"

"""What the guard of a run looks like now: members, removed and quarantined learners, paused merges, the
live settings, the outlier rule's median and bound — from the newest manifest plus the ops not merged yet.

Contract: read-only; one listing of the versions and one of control/ops, a few small reads; what `diloco
status`, the Prefect merge artifact and `diloco plot` show, and what the operator commands check against.
"""

from __future__ import annotations

from typing import Any

from diloco.run.context import RunContext
from diloco.run.controls import read_ops
from diloco.storage import Manifest, read_latest
from diloco.storage.window import with_window
from diloco.trust.guard import Policy, entry_of, initial_state, policy_after, state_of, window_median

# the merger reads these within a second (Merger.due, while it waits), not at its next merge: in effect, never
# pending
AT_ONCE = ("pause-merges", "resume-merges")


def current_policy(ctx: RunContext) -> tuple[Manifest | None, Policy]:
    """(the newest manifest, the policy the next merge will go by: its guard state + the pending ops)."""
    manifest = read_latest(ctx.store, ctx.keys)
    if manifest is not None:  # the window judged by (the operator's key reads it: learners' do not)
        manifest = with_window(ctx.store, ctx.keys, manifest)
    state = state_of(manifest, ctx.learners) if manifest is not None else initial_state(ctx.learners)
    entries = [entry_of(name, op) for name, op in read_ops(ctx.store, ctx.keys, state.ops_cursor)]
    return manifest, policy_after(state, entries, ctx.cfg)


def trust_summary(ctx: RunContext) -> dict[str, Any]:
    """The guard in one JSON-able dict (the pending ops are counted in: what the next merge applies; a pause
    or its end is in `paused` at once, never pending)."""
    manifest, policy = current_policy(ctx)
    state, cfg = policy.state, policy.cfg.merger
    median = window_median(state, policy.cfg)
    return {
        "members": state.members, "removed": state.removed, "quarantined": state.quarantined,
        "paused": state.paused, "settings": state.settings,
        "pending_ops": [f"{e.kind}{' ' + e.learner if e.learner else ''}" for e in policy.entries
                        if e.kind not in AT_ONCE],
        "outlier_rule": cfg.outlier_rule, "outlier_threshold": cfg.outlier_threshold,
        "outlier_median": median, "outlier_bound": None if median is None else median * cfg.outlier_threshold,
        "signed": policy.cfg.learner.sign, "version": None if manifest is None else manifest.version,
    }


def trust_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as a few lines for a terminal."""
    bound = summary["outlier_bound"]
    lines = [f"merges {'PAUSED' if summary['paused'] else 'running'} · outlier rule "
             f"{summary['outlier_rule']} (> {summary['outlier_threshold']:g}x the median norm per step"
             + (f": bound {bound:.3g}" if bound is not None else ": warming up") + ")"
             + (" · deltas signed" if summary["signed"] else "")]
    for name, why in summary["quarantined"].items():
        lines.append(f"quarantined: {name} {why} — diloco readmit --learner {name}")
    if summary["removed"]:
        lines.append(f"removed: {', '.join(summary['removed'])}")
    if summary["settings"]:
        lines.append("live settings: " + ", ".join(f"{k}={v}" for k, v in summary["settings"].items()))
    if summary["pending_ops"]:
        lines.append(f"pending (applied at the next merge): {', '.join(summary['pending_ops'])}")
    return lines


TRUST_MARKS = {"outlier": "#d62728", "signature": "#9467bd", "admission": "#ff7f0e", "quarantine": "#8c564b"}


def mark_trust(ax, events: list[dict], learners: list[str], t0: float) -> None:
    """On `diloco plot`'s timeline: an x per delta the guard rejected (by check) on its learner's row (a row
    below for names that never trained), and a diamond where a learner was quarantined; their legend beside
    the axes, below the states' (no text on the bars to collide with them)."""
    rows = {name: i for i, name in enumerate(learners)}
    other = len(learners)
    used: dict[str, object] = {}
    for e in events:
        if (e.get("source", "").startswith("merger") and e.get("kind") == "rejected"
                and e.get("check") in TRUST_MARKS):
            y = rows.get(e.get("learner"), other)
            (line,) = ax.plot(e["t"] - t0, y, marker="x", color=TRUST_MARKS[e["check"]], markersize=6,
                              linestyle="none", label=f"rejected: {e['check']}")
            used.setdefault(f"rejected: {e['check']}", line)
        elif e.get("kind") == "quarantine":
            y = rows.get(e.get("learner"), other)
            (line,) = ax.plot(e["t"] - t0, y, marker="D", color=TRUST_MARKS["quarantine"], markersize=6,
                              linestyle="none", label="quarantined")
            used.setdefault("quarantined", line)
    if used:
        states = ax.get_legend()
        ax.legend(handles=list(used.values()), loc="lower left", bbox_to_anchor=(1.01, 0.0), fontsize=7,
                  borderaxespad=0.0)
        if states is not None:
            ax.add_artist(states)  # keep the states' legend beside this one

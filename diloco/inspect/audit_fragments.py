"""`audit` of a fragmented run: every fragment's chain audited and replayed bit for bit on its own, the
reports folded into one (problems prefixed with their fragment), and the root chain kept at version 0.

Contract: read-only, like audit_run; `ok` only when every fragment's chain is ok.
"""

from __future__ import annotations

from diloco.inspect.audit import AuditReport, audit_run
from diloco.run.context import RunContext
from diloco.run.fragments import fragment_context, num_fragments
from diloco.storage import list_versions

COUNTS = ("deltas_merged", "deltas_rejected", "deltas_lost", "deltas_pending", "decisions_replayed",
          "decisions_unreplayable", "controls_applied")


def audit_fragments(ctx: RunContext, do_replay: bool = True,
                    keyring: dict[str, list[bytes]] | None = None) -> AuditReport:
    """One AuditReport over every fragment chain; num_versions is the run's (the fewest any fragment has)."""
    report = AuditReport(signatures_verified=keyring is not None and ctx.cfg.learner.sign)
    root = list_versions(ctx.store, ctx.keys)
    if root != [0]:
        report.problem(f"root chain of a fragmented run must hold version 0 only, holds {root[:10]}")
    per_fragment = []
    for index in range(num_fragments(ctx)):
        sub = audit_run(fragment_context(ctx, index), do_replay=do_replay, keyring=keyring)
        per_fragment.append(sub.num_versions)
        for name in COUNTS:
            setattr(report, name, getattr(report, name) + getattr(sub, name))
        report.replay_ok = report.replay_ok and sub.replay_ok
        for text in sub.problems:
            report.problem(f"fragment {index}: {text}")
    report.num_versions = min(per_fragment) if per_fragment else 0
    report.fragment_versions = per_fragment
    return report

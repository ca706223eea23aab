"""Where an operator sees the guard: the Prefect merge artifact's `(trust)` row (quarantined learners, the
outlier bound, the controls applied and by whom), `diloco status`'s lines, and `diloco plot`'s marks.

Run: .venv/bin/pytest tests/unit/test_trust_views.py -q
"""

from __future__ import annotations

from diloco.storage import DeltaDecision, Manifest
from diloco.storage.manifest import ControlEntry, GuardState
from diloco.trust.view import mark_trust, trust_lines


def _manifest() -> Manifest:
    guard = GuardState(members=["a", "b"],
                       quarantined={"b": "since version 7: 3 integrity rejections in a row"}, paused=False)
    controls = [ControlEntry(name="00000000000000000001-0000000a", kind="set", t=1.0, by="ann@ops",
                             values={"model.d_model": 8}, refused="model.d_model cannot change during a run")]
    decisions = [DeltaDecision(learner="b", seq=4, status="rejected", check="quarantine",
                               reason="quarantined ...")]
    return Manifest(run_id="r", version=8, parent=7, created_at=1.0, params_key="r/global/x.params",
                    params_checksum="c", decisions=decisions, guard=guard, controls=controls,
                    stats={"outlier_median": 0.5, "outlier_bound": 10.0})


def test_the_merge_artifact_has_a_trust_row() -> None:
    from diloco.tasks.merge import merge_table

    rows = merge_table(_manifest())
    assert rows[0]["check"] == "quarantine"
    trust = rows[-1]
    assert trust["learner"] == "(trust)" and "quarantined: b (since version 7" in trust["reason"]
    assert "outlier bound (norm/step) 10" in trust["reason"] and "set by ann@ops REFUSED" in trust["reason"]


def test_status_lines_name_the_quarantine_the_pause_and_what_is_pending() -> None:
    lines = trust_lines({"paused": True, "outlier_rule": "reject", "outlier_threshold": 20.0,
                         "outlier_bound": None,
                         "signed": True, "quarantined": {"b": "since version 7"}, "removed": ["c"],
                         "settings": {"merger.quorum": 2}, "pending_ops": ["resume-merges"]})
    text = "\n".join(lines)
    assert "merges PAUSED" in text and "warming up" in text and "deltas signed" in text
    assert "diloco readmit --learner b" in text and "removed: c" in text
    assert "merger.quorum=2" in text and "pending (applied at the next merge): resume-merges" in text


def test_the_plot_marks_rejections_by_check_and_quarantines() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], label="merge")
    ax.legend()
    events = [{"t": 5.0, "source": "merger", "kind": "rejected", "learner": "a", "check": "outlier"},
              {"t": 6.0, "source": "merger", "kind": "rejected", "learner": "rogue-0", "check": "admission"},
              {"t": 6.5, "source": "merger", "kind": "rejected", "learner": "a", "check": "stale"},
              {"t": 7.0, "source": "merger", "kind": "quarantine", "learner": "a"}]
    mark_trust(ax, events, ["a", "b"], t0=0.0)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["rejected: outlier", "rejected: admission", "quarantined"]  # stale is not the guard's
    assert not ax.texts  # a marker on the learner's row, no label to collide with the bars
    assert len(ax.artists) == 1  # the states' legend kept beside the guard's
    plt.close(fig)

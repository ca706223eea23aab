"""The direction measurement (`diloco outliers --directions`, diloco/trust/directions.py): each merged
delta's cosine with the other learners' deltas of its merge. On a tiny run of two honest learners every
honest delta points with the other's (cosine > 0); a sign-flipped copy of an honest delta, planted by an
admitted learner at an honest norm (the norm rule passes it), points against them.
Run: .venv/bin/pytest tests/integration/test_directions.py -q
"""

from __future__ import annotations

from pathlib import Path

from trust_helpers import decision, one_round, plant, publish_all, tiny_run

from diloco.api.operate import admit_learner
from diloco.trust.directions import directions, summarize_directions


def test_a_sign_flipped_delta_points_against_the_others(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path)
    for _ in range(4):
        one_round(learners, merger)
    honest = merger.version
    admit_learner(ctx, None, "flip-0")
    publish_all(learners)
    plant(ctx, "flip-0", 0, like=("local-0", learners[0].state.seq - 1), scale=-1.0, base=merger.version)
    m = merger.merge_once()
    assert decision(m, "flip-0", 0).status == "merged"  # an honest norm: the norm rule cannot tell
    for learner in learners:
        learner.close()
    rows = directions(ctx)
    before = [r for r in rows if r["version"] <= honest]
    assert len(before) == 2 * honest and all(r["cos_others"] > 0 for r in before), before
    (flipped,) = [r for r in rows if r["learner"] == "flip-0"]
    assert flipped["version"] == m.version and flipped["cos_others"] < 0, flipped
    assert all(r["cos_update"] is None for r in rows if r["version"] == 1)  # version 0 shipped no update
    summary = summarize_directions(before)
    assert summary["cos_others"]["n"] == 2 * honest and summary["cos_others"]["at_or_below_0"] == 0
    assert summary["cos_others"]["min"] > 0

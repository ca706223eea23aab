"""`diloco bench poll` (the merger's poll against the run's length) on file:// and the real S3 server: both
listings find exactly the new deltas, and the poll after each cursor lists O(learners) keys however many the
run has. Timings are printed by the command, never asserted. Run: .venv/bin/pytest
tests/integration/test_bench_poll.py -q
"""

from __future__ import annotations

import json

import pytest

from diloco.bench.poll import bench_poll


@pytest.mark.parametrize("where", ["file", "s3"])
def test_bench_poll_lists_only_what_is_new(where, tmp_path, request):
    storage = f"file://{tmp_path}/bucket" if where == "file" else request.getfixturevalue("s3_url")
    out = tmp_path / "poll.json"
    result = bench_poll.benchmark.run(out, storage=storage, learners=3, deltas="30,90", repeats=1,
                                      versions="20,60").data
    assert json.loads(out.read_text()) == result and result["learners"] == 3
    assert [r["deltas"] for r in result["rows"]] == [30, 90]
    for row in result["rows"]:
        assert row["keys_full"] == row["deltas"]  # the old poll: every delta of the run
        assert row["keys_after_cursor"] == 3 + 3  # three folders, then each learner's one new delta
        assert row["full_listing_s"] > 0 and row["after_cursor_s"] > 0
    assert [r["versions"] for r in result["version_rows"]] == [20, 60]
    for row in result["version_rows"]:
        assert row["keys_full"] == row["versions"]  # a stop check before: every version of the chain
        assert row["keys_after_known"] == 1  # a ChainWatch's: the one version after the one it knows


def test_bench_poll_refuses_bad_counts():
    with pytest.raises(ValueError, match="--deltas"):
        bench_poll(deltas="2", learners=3)
    with pytest.raises(ValueError, match="--versions"):
        bench_poll(deltas="3", learners=3, versions="1")

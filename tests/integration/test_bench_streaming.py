"""`diloco bench quality --quick --methods dp,streaming-int4`: the streaming row (4 fragments, tau 2, the
sharded merger) trains at equal tokens with data-parallel, lowers the held-out loss and ships int4 fragments.

Run: .venv/bin/pytest tests/integration/test_bench_streaming.py -q
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from diloco.cli import app


def test_streaming_row_at_equal_tokens(tmp_path):
    out = tmp_path / "q.json"
    result = CliRunner().invoke(app, ["bench", "quality", "--quick", "--methods", "dp,streaming-int4",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    methods = json.loads(out.read_text())["methods"]
    assert set(methods) == {"dp", "streaming-int4"}
    assert methods["dp"]["tokens"] == methods["streaming-int4"]["tokens"]
    row = methods["streaming-int4"]
    curve = row["seeds"][0]["curve"]
    assert curve[0][0] == 0 and curve[-1][0] == row["tokens"] and curve[-1][1] < curve[0][1]
    assert 0 < row["bytes_sent_per_learner"] < methods["dp"]["bytes_sent_per_learner"]

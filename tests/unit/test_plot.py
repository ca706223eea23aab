"""`diloco plot`: a PNG of held-out loss per version and a learner timeline, from a run's bucket only.

Run: .venv/bin/pytest tests/unit/test_plot.py   (a tiny run on file:// with synthetic evals and events)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from diloco.cli import app
from diloco.configs import load_config
from diloco.inspect.plot import loss_points, render_run_plot
from diloco.run.context import RunContext
from diloco.run.create import create_run
from diloco.run.events import EventLog
from diloco.storage import open_store


@pytest.fixture
def run(tmp_path: Path) -> RunContext:
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "plot-1", load_config("tiny"),
                     learners=["us-east-0", "eu-west-0"])
    for v in range(4):
        record = {"version": v, "loss": 5.5 - 0.4 * v, "bits_per_byte": (5.5 - 0.4 * v) / 0.693,
                  "tokens_total": 2560 * v}
        ctx.store.put(ctx.keys.eval(v), json.dumps(record).encode())
    sup, t = EventLog(ctx.store, ctx.keys, "supervisor"), 1000.0
    for i, name in enumerate(ctx.learners):
        sup.emit("start", role="learner", learner=name)
        log = EventLog(ctx.store, ctx.keys, name)
        log.emit("join", learner=name, version=0)
        log.emit("phase", learner=name, t_start=t + i, duration_s=2.0)
        log.emit("publish", learner=name, seq=0)
        log.emit("published", seq=0)
        log.flush()
    sup.emit("exit", role="learner", learner="us-east-0", state="CRASHED")
    sup.emit("restart", role="learner", learner="us-east-0", restarts=1)
    sup.flush()
    merger = EventLog(ctx.store, ctx.keys, "merger")
    merger.emit("merge", version=1)
    merger.flush()
    return ctx


def test_plot_writes_a_png(run: RunContext, tmp_path: Path) -> None:
    out = render_run_plot(run, tmp_path / "plots" / "run.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_of_an_empty_run_still_writes_a_png(tmp_path: Path) -> None:
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "empty-1", load_config("tiny"))
    assert render_run_plot(ctx, tmp_path / "empty.png").stat().st_size > 0


def test_loss_is_plotted_against_tokens_when_known() -> None:
    x, y, label = loss_points([{"version": 0, "loss": 5.0, "tokens_total": 0},
                               {"version": 1, "loss": 4.0, "tokens_total": 100}])
    assert (x, y, label) == ([0.0, 100.0], [5.0, 4.0], "tokens merged")
    assert loss_points([{"version": 0, "loss": 5.0}, {"version": 1, "loss": 4.0}])[2] == "version"


def test_cli_plot(run: RunContext, tmp_path: Path) -> None:
    out = tmp_path / "cli.png"
    result = CliRunner().invoke(app, ["plot", "--storage", run.store.url, "--run-id", run.run_id, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 0
    bad = CliRunner().invoke(app, ["plot", "--storage", run.store.url, "--run-id", "nope", "--out", str(out)])
    assert bad.exit_code == 2 and "no run" in bad.output


def test_start_up_is_starting_and_a_gap_between_phases_is_idle() -> None:
    """Before: a learner was 'down' from its start to its join (start-up is no outage) and a 20 s wait after
    a publish was drawn as 'publishing' (uploads run in the background while the next phase trains)."""
    from diloco.inspect.timeline import timeline

    ev = [{"t": 0.0, "source": "supervisor", "kind": "start", "role": "learner", "learner": "a"},
          {"t": 28.0, "source": "a", "kind": "join", "learner": "a"},
          {"t": 38.0, "source": "a", "kind": "phase", "learner": "a", "t_start": 28.1},
          {"t": 38.1, "source": "a", "kind": "publish", "learner": "a"},
          {"t": 48.2, "source": "a", "kind": "phase", "learner": "a", "t_start": 38.2},  # the ship step: training
          {"t": 70.0, "source": "a", "kind": "phase", "learner": "a", "t_start": 60.0},  # 12 s idle before
          {"t": 71.0, "source": "supervisor", "kind": "kill", "role": "learner", "learner": "a"},
          {"t": 75.0, "source": "supervisor", "kind": "end"}]
    rows = [(state, round(a, 1), round(b, 1)) for who, state, a, b in timeline(ev) if who == "a"]
    assert rows == [("starting", 0.0, 28.0), ("idle", 28.0, 28.1), ("training", 28.1, 48.2), ("idle", 48.2, 60.0),
                    ("training", 60.0, 70.0), ("idle", 70.0, 71.0), ("down", 71.0, 75.0)]

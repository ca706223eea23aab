"""`diloco plot`: a PNG of held-out loss per version and a learner timeline, from a run's bucket only; no two
of its labels collide (the version labels thinned, the legends beside the timeline, text inside the figure).

Run: .venv/bin/pytest tests/unit/test_plot.py   (a tiny run on file:// with synthetic evals and events)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from diloco.cli import app
from diloco.configs import load_config
from diloco.inspect.plot import MAX_VERSION_LABELS, draw_run_plot, labelled, loss_points, render_run_plot
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
    result = CliRunner().invoke(app, ["plot", "--storage", run.store.url, "--run-id", run.run_id, "--out",
                                      str(out)])
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
          # the ship step: training
          {"t": 48.2, "source": "a", "kind": "phase", "learner": "a", "t_start": 38.2},
          {"t": 70.0, "source": "a", "kind": "phase", "learner": "a", "t_start": 60.0},  # 12 s idle before
          {"t": 71.0, "source": "supervisor", "kind": "kill", "role": "learner", "learner": "a"},
          {"t": 75.0, "source": "supervisor", "kind": "end"}]
    rows = [(state, round(a, 1), round(b, 1)) for who, state, a, b in timeline(ev) if who == "a"]
    assert rows == [("starting", 0.0, 28.0), ("idle", 28.0, 28.1), ("training", 28.1, 48.2),
                    ("idle", 48.2, 60.0),
                    ("training", 60.0, 70.0), ("idle", 70.0, 71.0), ("down", 71.0, 75.0)]


def test_labelled_versions_are_evenly_spaced_and_keep_the_first_and_the_last() -> None:
    assert labelled(5) == [0, 1, 2, 3, 4]
    for n in (11, 38, 39, 40, 75, 400):
        picks = labelled(n)
        assert picks[0] == 0 and picks[-1] == n - 1 and len(picks) <= MAX_VERSION_LABELS, (n, picks)


def _drawn_texts(fig) -> list:
    """Titles, axis labels, annotations, legend entries and the tick labels inside each axis's view
    (matplotlib keeps labels of ticks beyond the limits, undrawn)."""
    out = [t for ax in fig.axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts)]
    for ax in fig.axes:
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            out += [t for t, at in zip(axis.get_ticklabels(), axis.get_ticklocs(),
                                       strict=True) if lo <= at <= hi]
        for legend in [ax.get_legend(), *ax.artists]:
            out += legend.get_texts() if legend is not None and hasattr(legend, "get_texts") else []
    return out


def test_no_two_labels_collide(tmp_path: Path) -> None:
    """Before: past a dozen versions their labels ran into each other, the legends sat on the bars and merges
    of the timeline, and a quarantine's label ran across them."""
    from itertools import combinations

    from matplotlib.legend import Legend

    names = ["us-east-0", "ap-south-a-long-region-name-0", "eu-west-0", "us-west-1"]
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "plot-2", load_config("tiny"), learners=names)
    for v in range(76):  # an eval a version (eval.every_versions 1), 6M tokens
        ctx.store.put(ctx.keys.eval(v), json.dumps({"version": v, "loss": 1.6 + 5.5 * 0.97 ** v,
                                                    "tokens_total": 80_000 * v}).encode())
    t = 1000.0
    for i, name in enumerate(names):
        log = EventLog(ctx.store, ctx.keys, name)
        log.emit("join", learner=name, version=0, t=t + 1 + i)
        for k in range(30):
            log.emit("phase", learner=name, t_start=t + 2 + 3 * k, duration_s=2.5, t=t + 4.5 + 3 * k)
        log.flush()
    merger = EventLog(ctx.store, ctx.keys, "merger")
    for v in range(1, 75):
        merger.emit("merge", version=v, t=t + 4 + 1.2 * v)
    merger.emit("rejected", learner="eu-west-0", check="outlier", t=t + 50)
    merger.emit("quarantine", learner="eu-west-0", t=t + 80)
    merger.flush()
    fig = draw_run_plot(ctx)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    top, bottom = fig.axes
    assert 2 <= len(top.texts) <= MAX_VERSION_LABELS and not bottom.texts
    texts = [t for t in _drawn_texts(fig) if t.get_visible() and t.get_text().strip()]
    boxes = [t.get_window_extent(r) for t in texts]
    clashes = [(a.get_text(), b.get_text())
               for (a, x), (b, y) in combinations(zip(texts, boxes, strict=True), 2)
               if x.overlaps(y)]
    assert clashes == []
    # nothing cut off
    assert all(fig.bbox.contains(b.x0, b.y0) and fig.bbox.contains(b.x1, b.y1) for b in boxes)
    legends = [a for a in [bottom.get_legend(), *bottom.artists] if isinstance(a, Legend)]
    assert len(legends) == 2
    frames = [legend.get_window_extent(r) for legend in legends]
    assert not frames[0].overlaps(frames[1])
    assert not any(f.overlaps(ax.get_window_extent(r)) for f in frames for ax in (top, bottom))
    import matplotlib.pyplot as plt

    plt.close(fig)

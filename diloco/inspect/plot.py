"""`diloco plot`: one PNG of a run — held-out loss per version, and what each learner did when.

Contract: reads only the bucket (evals/, events/); writes only the PNG asked for; a run without evals
or events still gets a figure that says so; no two labels collide (a constrained layout, the legends beside
the timeline, at most MAX_VERSION_LABELS version labels on the curve).
"""

from __future__ import annotations

from pathlib import Path

from diloco.evaluator.evaluator import read_evals
from diloco.run.context import RunContext
from diloco.run.events import read_events

MAX_VERSION_LABELS = 10  # `vN` labels on the loss curve: more, on a 10-inch axis, run into each other
STATE_COLORS = {"training": "#2ca02c", "starting": "#9ecae1", "idle": "#fdd0a2", "down": "#d62728",
                "paused": "#7f7f7f"}


def loss_points(evals: list[dict]) -> tuple[list[float], list[float], str]:
    """(x, held-out loss, x label): x = tokens merged when the evals carry them, else the version."""
    if evals and all(r.get("tokens_total") for r in evals if r.get("version", 0) > 0):
        return [float(r.get("tokens_total", 0)) for r in evals], [r["loss"] for r in evals], "tokens merged"
    return [float(r["version"]) for r in evals], [r["loss"] for r in evals], "version"


def timeline_rows(events: list[dict]) -> list[tuple[str, str, float, float]]:
    """(who, state, t0, t1) rows: learner states as intervals, merges as points (diloco.inspect.timeline)."""
    if not events:
        return []
    from diloco.inspect.timeline import timeline

    return timeline(events)


def labelled(n: int, most: int = MAX_VERSION_LABELS) -> list[int]:
    """The indices of n points that get a label: evenly spaced, at most `most`, the first and the last
    always."""
    if n <= most:
        return list(range(n))
    step = -(-(n - 1) // (most - 1))  # ceil: at most `most` picks from 0 to n - 1
    picks = list(range(0, n, step))
    if picks[-1] != n - 1:  # the last version is labelled; one closer to it than half a step gives way
        picks[-1:] = [n - 1] if n - 1 - picks[-1] < step / 2 else [picks[-1], n - 1]
    return picks


def _plot_loss(ax, evals: list[dict]) -> None:
    from matplotlib.ticker import EngFormatter

    x, y, label = loss_points(evals)
    if not x:
        ax.text(0.5, 0.5, "no held-out evaluations yet", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.plot(x, y, marker="o", markersize=4, color="#1f77b4")
        for i in labelled(len(x)):
            ax.annotate(f"v{evals[i]['version']}", (x[i], y[i]), textcoords="offset points", xytext=(3, 4),
                        fontsize=7)
    ax.margins(x=0.04, y=0.12)  # room for the first and last labels inside the frame
    if label == "tokens merged":
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 1.5M, not 1.5 with "1e6" in the corner
    ax.set_xlabel(label)
    metric = evals[-1].get("metric", "nats/byte") if evals else "nats/byte"  # the spec's metric name
    ax.set_ylabel(f"held-out loss ({metric})")
    ax.grid(alpha=0.3)


def _plot_timeline(ax, rows: list[tuple[str, str, float, float]]) -> None:
    intervals = [r for r in rows if r[1] in STATE_COLORS]
    if not rows:
        ax.text(0.5, 0.5, "no events recorded", ha="center", va="center", transform=ax.transAxes)
        return
    t0 = min(r[2] for r in rows)
    learners = sorted({r[0] for r in intervals})
    for i, name in enumerate(learners):
        for state, color in STATE_COLORS.items():
            spans = [(a - t0, b - a) for who, s, a, b in intervals if who == name and s == state and b > a]
            if spans:
                ax.broken_barh(spans, (i - 0.35, 0.7), facecolors=color)
    merges = [a - t0 for _, s, a, _ in rows if s == "merge"]
    for j, t in enumerate(merges):
        ax.axvline(t, color="black", alpha=0.35, linewidth=0.8, label="merge" if j == 0 else None)
    handles = [ax.bar(0, 0, color=c, label=s) for s, c in STATE_COLORS.items()]
    # beside the axes, not over the bars and merges (mark_trust puts the guard's legend below this one)
    ax.legend(handles=[*handles, *ax.get_lines()[:1]], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=7, borderaxespad=0.0)
    ax.set_yticks(range(len(learners)), learners)
    ax.set_ylim(-0.6, max(len(learners), 1) - 0.4)
    ax.set_xlabel("seconds since the first event")


def draw_run_plot(ctx: RunContext):
    """The figure of a run: its loss curve above, its learner timeline below (a matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = read_evals(ctx)
    events = read_events(ctx.store, ctx.keys)
    rows = timeline_rows(events)
    num_learners = len({r[0] for r in rows if r[1] in STATE_COLORS})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6 + 0.3 * num_learners), layout="constrained",
                                      gridspec_kw={"height_ratios": [1, 1 + 0.1 * num_learners]})
    _plot_loss(top, evals)
    top.set_title(f"run {ctx.run_id}: held-out loss")
    _plot_timeline(bottom, rows)
    if rows:  # rejections by the guard (outlier, signature, admission, quarantine) and quarantines
        from diloco.trust.view import mark_trust

        mark_trust(bottom, events, sorted({r[0] for r in rows if r[1] in STATE_COLORS}),
                   min(r[2] for r in rows))
    bottom.set_title("what each learner did when (merges: the vertical lines)")
    return fig


def render_run_plot(ctx: RunContext, out: Path) -> Path:
    """Draw the loss curve and the learner timeline of a run into `out` (PNG)."""
    import matplotlib.pyplot as plt

    fig = draw_run_plot(ctx)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

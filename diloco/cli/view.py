"""What `diloco run` and `diloco status` show: the live progress table, the final summary, the status.

Contract: every figure is read from the bucket, never from in-memory counters; imported only when a command
runs (it pulls torch, for the sample), so `diloco --help` stays fast.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from diloco.inspect.report import learner_status, nats_to_bits, sample_text, summarize, summary_json
from diloco.run.context import RunContext, open_run
from diloco.storage import StorageError, latest_version, open_store


def progress_table(ctx: RunContext, started: float) -> Table:
    from diloco.run.evaluator import read_evals

    try:
        version = latest_version(ctx.store, ctx.keys) or 0
        evals = read_evals(ctx)
        rows = learner_status(ctx)
    except StorageError as err:
        table = Table(title=f"run {ctx.run_id}: storage unavailable ({err})")
        return table
    last = evals[-1] if evals else None
    loss = f"{last['loss']:.3f} {last.get('metric', 'nats/byte')} @ v{last['version']}" if last else "—"
    table = Table(title=f"run {ctx.run_id} · version {version}/{ctx.cfg.run.num_versions} · "
                        f"held-out {loss} · {time.time() - started:.0f}s")
    for col in ("learner", "state", "ranks", "seq", "base", "step", "loss", "steps/s", "MB sent", "heartbeat"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.get("learner", "?"), r.get("state", "?"), str(r.get("ranks", 1)), str(r.get("seq", "")), str(r.get("base_version", "")),
            str(r.get("step", "")), f"{r['loss']:.3f}" if isinstance(r.get("loss"), float) else "",
            f"{r.get('steps_per_s', 0):.1f}" if "steps_per_s" in r else "",
            f"{r.get('bytes_published', 0) / 1e6:.2f}" if "bytes_published" in r else "",
            f"{r['age_s']:.0f}s ago" if "age_s" in r else "",
        )
    return table


class LiveView:
    """A background thread that redraws the progress table from the bucket once a second."""

    def __init__(self, ctx: RunContext, console: Console, enabled: bool) -> None:
        self.ctx, self.console, self.enabled = ctx, console, enabled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.started = time.time()

    def __enter__(self) -> LiveView:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        with Live(progress_table(self.ctx, self.started), console=self.console, refresh_per_second=1,
                  transient=False) as live:
            while not self._stop.wait(1.0):
                live.update(progress_table(self.ctx, self.started))


def execute_run(*, config: str, storage: str | None, learners: int | None, versions: int | None,
                corpus: str | None, run_id: str | None, json_out: bool, prefect: bool, chaos: Path | None,
                time_limit_s: float | None, live: bool, spec: str | None = None, spec_args: list[str] = (),
                overrides: list[str] = ()) -> None:
    from diloco import api
    from diloco.configs import parse_overrides
    from diloco.configs.effects import knob_warnings
    from diloco.specs.loader import absolute, parse_spec_args

    overrides = {**parse_overrides(list(overrides)),
                 "run.num_learners": learners, "run.num_versions": versions, "data.corpus": corpus,
                 "run.storage": storage, "run.time_limit_s": time_limit_s,
                 "spec": absolute(spec) if spec else None,
                 "spec_args": parse_spec_args(list(spec_args)) if spec_args else None}
    cfg = api.resolve_config(config, overrides)
    ctx = api.create(cfg, run_id, chaos)
    console = Console(stderr=json_out)
    for line in knob_warnings(config, overrides, cfg, "prefect" if prefect else cfg.run.start_method):
        console.print(f"[yellow]warning:[/yellow] {line}", markup=True, highlight=False)
    console.print(f"[bold]diloco[/bold] run [cyan]{ctx.run_id}[/cyan] in {ctx.store.url}: "
                  f"{cfg.run.num_learners} learners, target {cfg.run.num_versions} versions, recipe {cfg.name}")
    with LiveView(ctx, console, live and console.is_terminal):
        api.supervise(ctx, prefect=prefect, chaos=chaos, announce=console.print)
    _final_report(ctx, console, json_out)


def _final_report(ctx: RunContext, console: Console, json_out: bool) -> None:
    summary = summarize(ctx)
    table = Table(title=f"run {ctx.run_id} — summary")
    table.add_column("what")
    table.add_column("value")
    for label, value in _summary_rows(summary):
        table.add_row(label, value)
    console.print(table)
    try:
        text = sample_text(ctx)
        if text is not None:
            console.print("[bold]Sampled from the final model:[/bold]")
            console.print(text, markup=False, highlight=False)
    except (StorageError, ValueError) as err:  # ValueError: the spec's (SpecError) or the run's (RunError)
        console.print(f"(no sample: {err})")
    if json_out:
        typer.echo(json.dumps(summary_json(summary)))


def _fmt_loss(loss: float | None, metric: str = "nats/byte") -> str:
    if loss is None:
        return "—"
    if metric == "nats/byte":
        return f"{loss:.3f} nats/byte ({nats_to_bits(loss):.3f} bits/byte)"
    return f"{loss:.4f} {metric}"


def _summary_rows(s: dict) -> list[tuple[str, str]]:
    ratio = s["traffic_ratio_vs_dp"]
    return [
        ("held-out loss, version 0", _fmt_loss(s["initial_eval_loss"], s["metric"])),
        (f"held-out loss, version {s['final_eval_version']}", _fmt_loss(s["final_eval_loss"], s["metric"])),
        ("versions committed", str(s["num_versions"])),
        ("deltas merged / rejected", f"{s['deltas_merged']} / {s['deltas_rejected']}"),
        ("tokens merged", f"{s['tokens_merged']:,}"),
        ("bytes published (all learners)", f"{s['bytes_published'] / 1e6:.2f} MB"),
        ("data-parallel would have sent", f"{s['dp_bytes_equivalent'] / 1e6:.1f} MB"
         + (f"  ({ratio:.0f}x more)" if ratio else "")),
        ("run lives at", f"{s['storage']}/{s['run_id']}"),
    ]


def print_status(storage: str, run_id: str, json_out: bool) -> None:
    ctx = open_run(open_store(storage), run_id)
    version = latest_version(ctx.store, ctx.keys)
    rows = learner_status(ctx)
    from diloco.inspect.trust import trust_lines, trust_summary

    trust = trust_summary(ctx)
    if json_out:
        typer.echo(json.dumps({"run_id": run_id, "latest_version": version, "learners": rows, "trust": trust}))
        return
    Console().print(progress_table(ctx, time.time()))
    for line in trust_lines(trust):
        Console().print(line, markup=False, highlight=False)

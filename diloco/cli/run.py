"""`diloco run` and `diloco status`: set up a run, supervise it with a live view, summarize it.

Contract: the run is created (or joined, same config) before any process starts; the summary
and JSON are computed from the bucket, never from in-memory counters.
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

from diloco.configs import load_config
from diloco.inspect.report import learner_status, nats_to_bits, sample_text, summarize
from diloco.run.context import RunContext, create_run, open_run
from diloco.storage import StorageError, latest_version, open_store

STATE_DIR = Path(".diloco")


def progress_table(ctx: RunContext, started: float) -> Table:
    from diloco.run.loops import read_evals

    try:
        version = latest_version(ctx.store, ctx.keys) or 0
        evals = read_evals(ctx)
        rows = learner_status(ctx)
    except StorageError as err:
        table = Table(title=f"run {ctx.run_id}: storage unavailable ({err})")
        return table
    last = evals[-1] if evals else None
    loss = f"{last['loss']:.3f} nats/byte @ v{last['version']}" if last else "—"
    table = Table(title=f"run {ctx.run_id} · version {version}/{ctx.cfg.run.num_versions} · "
                        f"held-out {loss} · {time.time() - started:.0f}s")
    for col in ("learner", "state", "seq", "base", "step", "loss", "steps/s", "MB sent", "heartbeat"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.get("learner", "?"), r.get("state", "?"), str(r.get("seq", "")), str(r.get("base_version", "")),
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


def _resolve(config: str, storage: str | None, learners: int | None, versions: int | None,
             corpus: str | None, time_limit_s: float | None):
    cfg = load_config(config).with_overrides({
        "run.num_learners": learners, "run.num_versions": versions, "data.corpus": corpus,
        "run.storage": storage, "run.time_limit_s": time_limit_s,
    })
    return cfg


def execute_run(*, config: str, storage: str | None, learners: int | None, versions: int | None,
                corpus: str | None, run_id: str | None, json_out: bool, prefect: bool, chaos: Path | None,
                time_limit_s: float | None, live: bool) -> None:
    from diloco.run.corpus import load_run_corpus
    from diloco.storage.keys import validate_run_id

    cfg = _resolve(config, storage, learners, versions, corpus, time_limit_s)
    run_id = validate_run_id(run_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if chaos is not None:
        from diloco.chaos.plan import load_plan

        load_plan(chaos)  # validate before anything is created
    load_run_corpus(cfg.data)  # a bad corpus fails here, before the run exists
    store = open_store(cfg.run.storage)
    ctx = create_run(store, run_id, cfg)
    console = Console(stderr=json_out)
    console.print(f"[bold]diloco[/bold] run [cyan]{run_id}[/cyan] in {store.url}: "
                  f"{cfg.run.num_learners} learners, target {cfg.run.num_versions} versions, recipe {cfg.name}")
    log_dir = str(STATE_DIR / "logs" / run_id)
    server = None
    if prefect:
        from diloco.flows.server import ensure_api, stop_api

        url, server = ensure_api(STATE_DIR / "prefect")
        console.print(f"Prefect API {url} (UI: {url.removesuffix('/api')})")
    try:
        with LiveView(ctx, console, live and console.is_terminal):
            _supervise(ctx, store.url, prefect, log_dir, str(chaos) if chaos else None)
    finally:
        if server is not None:
            stop_api(server)
    _final_report(ctx, console, json_out)


def _supervise(ctx: RunContext, storage_url: str, prefect: bool, log_dir: str, chaos: str | None) -> None:
    if prefect:
        from prefect import tags

        from diloco.flows.train import train_flow

        with tags(f"run:{ctx.run_id}", "role:train"):
            train_flow(storage_url, ctx.run_id, log_dir=log_dir, chaos_plan=chaos)
        return
    from diloco.supervise.local import Supervisor

    supervisor = Supervisor(ctx, prefect=False, log_dir=log_dir)
    if chaos:
        from diloco.chaos.agent import attach_chaos

        attach_chaos(supervisor, chaos)
    supervisor.run_to_end()


def _final_report(ctx: RunContext, console: Console, json_out: bool) -> None:
    summary = summarize(ctx)
    table = Table(title=f"run {ctx.run_id} — summary")
    table.add_column("what")
    table.add_column("value")
    for label, value in _summary_rows(summary):
        table.add_row(label, value)
    console.print(table)
    try:
        console.print("[bold]Sampled from the final model:[/bold]")
        console.print(sample_text(ctx), markup=False, highlight=False)
    except StorageError as err:
        console.print(f"(no sample: {err})")
    if json_out:
        keys = ("run_id", "storage", "num_versions", "num_learners", "initial_eval_loss", "final_eval_loss",
                "deltas_merged", "deltas_rejected", "bytes_published")
        typer.echo(json.dumps({k: summary[k] for k in keys} | {"extra": {k: v for k, v in summary.items() if k not in keys}}))


def _fmt_loss(loss: float | None) -> str:
    return "—" if loss is None else f"{loss:.3f} nats/byte ({nats_to_bits(loss):.3f} bits/byte)"


def _summary_rows(s: dict) -> list[tuple[str, str]]:
    ratio = s["traffic_ratio_vs_dp"]
    return [
        ("held-out loss, version 0", _fmt_loss(s["initial_eval_loss"])),
        (f"held-out loss, version {s['final_eval_version']}", _fmt_loss(s["final_eval_loss"])),
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
    if json_out:
        typer.echo(json.dumps({"run_id": run_id, "latest_version": version, "learners": rows}))
        return
    Console().print(progress_table(ctx, time.time()))

"""`diloco runs`, `diloco summary`, `diloco ui`: find the runs in a storage, summarize one, reopen the UI.

Contract: runs and summary only read the bucket (summary evaluates, and records, the version 0 and final
version of an ended run the evaluator did not reach); ui serves the project's local Prefect server
(.diloco/prefect) with the API URL its pages need, until Ctrl-C; bad arguments are one line, exit 2.
"""

from __future__ import annotations

import json
import time

import typer

from diloco.cli.errors import user_errors
from diloco.cli.options import JSON, RUN_AND_INSPECT, RUN_ID, STORAGE

app = typer.Typer()


@app.command("runs", rich_help_panel=RUN_AND_INSPECT)
def runs(storage: str = STORAGE, json_out: bool = JSON) -> None:
    """List the runs in a storage URL: state, versions, last held-out loss, learners, traffic vs
    data-parallel, bytes in the bucket."""
    with user_errors():
        from rich.console import Console
        from rich.table import Table

        from diloco.inspect.runs import list_runs
        from diloco.storage import open_store

        store = open_store(storage)
        rows = list_runs(store)
        if json_out:
            typer.echo(json.dumps({"storage": store.url, "runs": rows}))
            return
        if not rows:
            typer.echo(f"no runs in {store.url}")
            return
        table = Table(title=f"runs in {store.url}")
        table.add_column("run id", no_wrap=True,
                         min_width=max(len("run id"), *(len(r["run_id"]) for r in rows)))
        table.add_column("state", no_wrap=True, min_width=max(len(r["state"]) for r in rows))
        for col in ("versions", "held-out", "learners", "sent / recv MB per learner", "vs DP", "bucket",
                    "age"):
            table.add_column(col, overflow="fold", min_width=min(len(col), 6))
        for r in rows:
            if r["state"] == "unreadable":
                table.add_row(r["run_id"], "unreadable", r["problem"], "", "", "", "", "", "")
                continue
            loss = (f"{r['last_eval_loss']:.3f} (v{r['last_eval_version']})"
                    if r["last_eval_loss"] is not None else "—")
            versions = f"{r['version']}/{r['target']}"
            # a token budget ends the run: the version, and the share of the budget merged
            if r.get("token_budget"):
                versions = f"{r['version']} ({100.0 * r['tokens'] / r['token_budget']:.0f}%)"
            table.add_row(r["run_id"], r["state"], versions, loss, str(r["num_learners"]), *_traffic_cells(r),
                          _bytes(r["bucket_bytes"]), _age(time.time() - r["created_at"]))
        Console().print(table)
        Console().print("traffic: every object a learner put and got (deltas, checkpoints, statuses, events, "
                        "updates, manifests, listings); vs DP: data-parallel's fp32 all-reduce bytes over "
                        "them, "
                        "sent / received (deltas only in brackets)")


def _traffic_cells(r: dict) -> tuple[str, str]:
    """'sent / received' MB per learner, and data-parallel's bytes over them ('—' where not counted)."""
    sent, received = r.get("bytes_sent_per_learner"), r.get("bytes_received_per_learner")
    if sent is None:
        return "—", "—"
    mb = f"{sent / 1e6:.2f} / {received / 1e6:.2f}" if received is not None else f"{sent / 1e6:.2f} / —"

    def ratio(x: float | None) -> str:
        return "—" if not x else f"{x:.0f}x" if x >= 1 else f"1/{1 / x:.1f}x"

    delta = r.get("delta_traffic_ratio_vs_dp")
    return mb, (f"{ratio(r.get('traffic_ratio_vs_dp'))} / {ratio(r.get('received_ratio_vs_dp'))}"
                + (f" ({ratio(delta)})" if delta else ""))


def _bytes(size: int) -> str:
    """1.2 GB, 340 MB, 12 kB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"


def _age(seconds: float) -> str:
    """3m, 2h, 5d."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{max(0.0, seconds):.0f}s"


@app.command("summary", rich_help_panel=RUN_AND_INSPECT)
def summary(storage: str = STORAGE, run_id: str = RUN_ID, json_out: bool = JSON) -> None:
    """The summary `diloco run` ends with, for any run (local or deployed, live or ended)."""
    with user_errors():
        from rich.console import Console

        from diloco.cli.view import final_report
        from diloco.run.context import open_run

        ctx = open_run(storage, run_id)
        final_report(ctx, Console(stderr=json_out), json_out)


@app.command("ui", rich_help_panel=RUN_AND_INSPECT)
def ui(port: int = typer.Option(4200, "--port", min=0, max=65535,
                                help="Port of the UI (0, or taken: a free one)."),
       home: str = typer.Option(".diloco/prefect", "--home",
                                help="The Prefect home the runs reported to.")) -> None:
    """(Re)open the local Prefect server of this project's runs, with the right API URL, until Ctrl-C."""
    from pathlib import Path

    from diloco.flows.ui import serve_ui

    with user_errors():
        serve_ui(Path(home), port, announce=typer.echo)

"""What `diloco run`, `diloco status` and `diloco summary` show: the live table, the summary, the status.

Contract: every figure is read from the bucket, never from in-memory counters; a run that ended says so
(finished / stopped / removed, and the command that continues it); each failed learner's last error line and
log are shown under the live table and after the summary, and a run that failed (diloco.inspect.outcome) says
why after them and exits with code 3 (a time limit that ended it short: one line, exit 0); SIGINT and SIGTERM
end `diloco run` in order — every process of the run ends, the summary so far is printed — with exit code 130
/ 143; tables stay readable at 80 columns (a name is never cut at its end: one too long for the width is
shortened from the middle, its distinguishing suffix kept; other cells wrap); while the live table is drawn,
what this process writes to stderr (Prefect's console log, warnings) goes to .diloco/logs/<run>/supervisor.log
instead. Imported only when a command runs (it pulls torch, for the sample), so `diloco --help` stays fast.
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

import typer
from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

from diloco.inspect.outcome import EXIT_CODE, status_failure_lines
from diloco.inspect.report import learner_status, sample_text, summary_json
from diloco.run.context import RunContext, open_run
from diloco.run.fragments import chain_report
from diloco.run.state import RunState, learner_word, read_run_state
from diloco.run.target import run_target
from diloco.storage import StorageError, open_store
from diloco.storage.records import FINAL_STATES

STATUS_COLUMNS = ("state", "ranks", "seq", "base", "step", "loss", "steps/s", "MB out", "beat")


def _name_column(table: Table, header: str, names: list[str]) -> None:
    """A column that is never cut: the distinguishing suffix of us-east-0 / us-east-1 must show."""
    table.add_column(header, no_wrap=True, min_width=max([len(header), *map(len, names)]))


MIN_NAME_CHARS = 9  # "eu…name-0": a name shortened from the middle keeps at least this much


def shorten_middle(names: list[str], width: int) -> list[str]:
    """Names cut to `width` from the middle ("eu-west-long-region-0" -> "eu-…egion-0"): the start and the
    distinguishing suffix stay; widened until every shortened name is still unique."""
    longest = max(map(len, names), default=0)
    for w in range(max(width, MIN_NAME_CHARS), longest + 1):
        keep = w - 1
        short = [n if len(n) <= w else f"{n[:keep // 3]}…{n[len(n) - (keep - keep // 3):]}" for n in names]
        if len(set(short)) == len(set(names)):
            return short
    return names


def _status_cells(r: dict, word: str) -> list[str]:
    """A learner's figures, in STATUS_COLUMNS order."""
    return [word, str(r.get("ranks", 1)), str(r.get("seq", "")), str(r.get("base_version", "")),
            str(r.get("step", "")), f"{r['loss']:.3f}" if isinstance(r.get("loss"), float) else "",
            f"{r.get('steps_per_s', 0):.1f}" if "steps_per_s" in r else "",
            f"{r.get('bytes_published', 0) / 1e6:.2f}" if "bytes_published" in r else "",
            f"{r['age_s']:.0f}s ago" if "age_s" in r else
            "future" if "ahead_s" in r else ""]  # a beat from the future: ignored (future_lines)


def progress_table(ctx: RunContext, started: float | None, state: RunState | None = None,
                   width: int | None = None) -> Table:
    """The status table of `diloco status` and the live view; `width`: the console's (default: this
    terminal's)."""
    from diloco.evaluator.evaluator import read_evals
    from diloco.trust.view import current_policy

    try:
        evals = read_evals(ctx)
        rows = learner_status(ctx)
        state = state or read_run_state(ctx)
        removed = {r["learner"] for r in rows if ctx.store.exists(ctx.keys.removed(r["learner"]))}
        paused = current_policy(ctx)[1].state.paused  # `diloco pause-merges`: the learners train on
    except StorageError as err:
        return Table(title=f"run {ctx.run_id}: storage unavailable ({err})")
    last = evals[-1] if evals else None
    loss = f"{last['loss']:.3f} {last.get('metric', 'nats/byte')} @ v{last['version']}" if last else "—"
    if state.ended:
        head = state.title() + (" (merges paused)" if paused else "")
    else:
        head = f"{state.word}{', merges paused' if paused else ''} · {state.where()}"
    clock = f" · {time.time() - started:.0f}s" if started else ""
    cells = [_status_cells(r, learner_word(r.get("state"), r.get("learner") in removed, state)) for r in rows]
    # no rules between columns (each costs its width + 2): ten columns of everyday names fit in 80 (with rules
    # they took 83 and rich cut the last one off); a name too long for what is left is shortened from the
    # middle
    figures = sum(2 + max([len(col), *(len(c[i]) for c in cells)]) for i, col in enumerate(STATUS_COLUMNS))
    names = shorten_middle([r.get("learner", "?") for r in rows], (width or Console().width) - figures - 3)
    table = Table(title=f"run {ctx.run_id} · {head} · held-out {loss}{clock}", box=box.SIMPLE_HEAD,
                  show_edge=False, collapse_padding=True)
    _name_column(table, "learner", names)
    table.add_column("state", no_wrap=True)
    for col in STATUS_COLUMNS[1:]:
        table.add_column(col, overflow="fold", justify="right")
    for name, row in zip(names, cells, strict=True):
        table.add_row(name, *row)
    # each failed learner's last error line and its log, under the table
    if failed := status_failure_lines(rows):
        table.caption, table.caption_justify, table.caption_style = "\n".join(failed), "left", "red"
    return table


class StderrToLog(io.TextIOBase):
    """This process's sys.stderr while the live table is drawn: what is written to it goes to a log file, not
    through the table; once `end()` is called, to the terminal again. Prefect's console log handler (on the
    root logger, made when Prefect is imported: inside the run, so with this as its stream) prints with a rich
    Console of its own, which would write around the Live's redirection and break the table; warnings of the
    engine likewise."""

    def __init__(self, terminal: TextIO, path: Path) -> None:
        self.terminal, self.lines = terminal, 0
        self.path: Path | None = path  # None once the table is gone
        self._file: TextIO | None = None
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            if self.path is None:  # the table is gone
                return self.terminal.write(text)
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by end()
            self.lines += text.count("\n")
            written = self._file.write(text)
            self._file.flush()
            return written

    def flush(self) -> None:
        with self._lock:
            (self.terminal if self.path is None else self._file or self.terminal).flush()

    def isatty(self) -> bool:
        return False  # a rich Console over it writes plain text, no colour codes, into the file

    def fileno(self) -> int:
        return self.terminal.fileno()  # a write to the descriptor itself goes where it always went

    def end(self) -> None:
        with self._lock:
            self.path = None
            if self._file is not None:
                self._file.close()


class LiveView:
    """A background thread that redraws the progress table from the bucket once a second; while it is drawn,
    this process's stderr goes to `log_path` (default .diloco/logs/<run>/supervisor.log: StderrToLog)."""

    def __init__(self, ctx: RunContext, console: Console, enabled: bool,
                 log_path: Path | None = None) -> None:
        from diloco.api import STATE_DIR

        self.ctx, self.console, self.enabled = ctx, console, enabled
        self.log_path = log_path or STATE_DIR / "logs" / ctx.run_id / "supervisor.log"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._stderr: StderrToLog | None = None
        self.started = time.time()

    def __enter__(self) -> LiveView:
        if self.enabled:
            # held to the terminal it draws on (a --json run draws on stderr)
            self.console.file = self.console.file
            self._stderr = StderrToLog(sys.stderr, self.log_path)
            sys.stderr = self._stderr
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join(timeout=5)
        if self._stderr is not None:
            sys.stderr = self._stderr.terminal
            self._stderr.end()  # a handler that holds it writes to the terminal from now on
            if self._stderr.lines:
                self.console.print(f"Prefect's log while the table was live: {self.log_path} "
                                   f"({self._stderr.lines} lines)", markup=False, highlight=False,
                                   soft_wrap=True)

    def _loop(self) -> None:
        with Live(progress_table(self.ctx, self.started, width=self.console.width), console=self.console,
                  refresh_per_second=1, transient=False, redirect_stderr=False) as live:
            while not self._stop.wait(1.0):
                live.update(progress_table(self.ctx, self.started, width=self.console.width))


def execute_run(*, config: str, storage: str | None, learners: int | None, versions: int | None,
                tokens: int | None = None, corpus: str | None, run_id: str | None, json_out: bool,
                prefect: bool, chaos: Path | None,
                time_limit_s: float | None, live: bool, spec: str | None = None, spec_args: list[str] = (),
                overrides: list[str] = ()) -> None:
    from diloco import api
    from diloco.configs import parse_overrides
    from diloco.configs.effects import knob_warnings
    from diloco.run.state import refuse_to_start
    from diloco.specs.loader import absolute, parse_spec_args
    from diloco.supervise.interrupt import catch_signals

    flags = {"run.num_learners": learners, "run.num_versions": versions, "run.num_tokens": tokens,
             "data.corpus": corpus, "run.storage": storage, "run.time_limit_s": time_limit_s,
             "spec": absolute(spec) if spec else None,
             "spec_args": parse_spec_args(list(spec_args)) if spec_args else None}
    # a flag given wins over `-o` of the same key; one not given leaves `-o`'s value (None would drop it)
    overrides = {**parse_overrides(list(overrides)), **{k: v for k, v in flags.items() if v is not None}}
    with catch_signals():  # from here on, Ctrl-C and SIGTERM end the run in order (supervise/interrupt.py)
        cfg = api.resolve_config(config, overrides)
        ctx = api.create(cfg, run_id, chaos)
        refuse_to_start(ctx)  # a finished or stopped run, or one another supervisor runs: one line, exit 2
        console = Console(stderr=json_out)
        for line in knob_warnings(config, overrides, cfg, "prefect" if prefect else cfg.run.start_method):
            console.print(f"[yellow]warning:[/yellow] {line}", markup=True, highlight=False)
        console.print(f"[bold]diloco[/bold] run [cyan]{ctx.run_id}[/cyan] in {ctx.store.url}: "
                      f"{cfg.run.num_learners} learners, target {run_target(ctx).describe()}, "
                      f"recipe {cfg.name}")
        if ctx.data_source:  # what the spec read: e.g. a folder's "N files (k skipped: not text)"
            console.print(f"data: {ctx.data_source}", markup=False, highlight=False)
        local_ui = prefect and not os.environ.get("PREFECT_API_URL")
        with LiveView(ctx, console, live and console.is_terminal):
            reason = api.supervise(ctx, prefect=prefect, chaos=chaos, announce=console.print)
        summary = final_report(ctx, console, json_out, reason=reason, local_ui=local_ui)
    exit_for(reason, summary)


def exit_for(reason: str, summary: dict) -> None:
    """The exit code of a supervised run: a signal's (130 / 143), EXIT_CODE when the run failed
    (diloco.inspect.outcome), else 0 (the target, the user's stop, the time limit)."""
    from diloco.supervise.interrupt import reason_of

    caught = reason_of(reason)
    if caught is not None:
        raise typer.Exit(caught.exit_code)
    if summary.get("failure"):
        raise typer.Exit(EXIT_CODE)


def final_report(ctx: RunContext, console: Console, json_out: bool, *, reason: str | None = None,
                 local_ui: bool = False) -> dict:
    """What happened (an interrupt, a failure and each failed learner's error and log, a time limit), the
    summary table, traffic per learner, a sample, the next step; returns the summary."""
    import torch

    from diloco.evaluator.evaluator import evaluate_missing
    from diloco.inspect.summary import LEARNER_COLUMNS, build_summary, learner_table_rows, summary_rows
    from diloco.supervise.interrupt import reason_of

    # One thread for the final evaluations and the sample: on 2 cores shared with other work, torch's default
    # pool spun for 30 s on a 240-byte sample that takes 1.3 s on one thread (seen once).
    torch.set_num_threads(1)
    # what the evaluator did not reach (a short run can end before it starts); a live run's evaluator is at it
    done = evaluate_missing(ctx) if read_run_state(ctx).word != "running" else []
    if done:
        console.print(f"evaluated version {' and '.join(map(str, done))} now (the evaluator did not reach "
                      "it)")
    summary = build_summary(ctx)
    caught = reason_of(reason or "")
    if caught is not None:
        console.print(f"[bold]{caught.reason}[/bold] (signal {caught.signal}) at version "
                      f"{summary['num_versions']} of {run_target(ctx).describe()}: every process of the run "
                      "has ended; the summary so far:",
                      soft_wrap=True)
    table = Table(title=f"run {ctx.run_id} — summary")
    table.add_column("what", no_wrap=True)
    table.add_column("value", overflow="fold")
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    console.print(table)
    traffic = Table(title="traffic per learner (MB)")
    _name_column(traffic, LEARNER_COLUMNS[0], [r["learner"] for r in summary["learners"]])
    for col in LEARNER_COLUMNS[1:]:
        traffic.add_column(col.removesuffix(" MB"), overflow="fold", justify="right")
    for row in learner_table_rows(summary):
        traffic.add_row(*row)
    console.print(traffic)
    _print_sample(ctx, console)
    if local_ui:
        console.print("Prefect UI: the local server stopped with the run; `diloco ui` reopens it")
    _print_ending(ctx, console, summary)
    if summary.get("continue"):
        console.print(summary["continue"], markup=False, highlight=False, soft_wrap=True)
    if json_out:
        typer.echo(json.dumps(summary_json(summary)))
    return summary


def _print_ending(ctx: RunContext, console: Console, summary: dict) -> None:
    """Last, where the eye falls: each failed learner's error line and log, and why the run failed (or the one
    line of a time limit that ended it short)."""
    from diloco.inspect.outcome import failure_lines
    from diloco.inspect.summary import ending_line

    for line in failure_lines(summary["failed_learners"]):
        console.print(line, style="red", markup=False, highlight=False, soft_wrap=True)
    if summary["failure"]:
        console.print(f"run {ctx.run_id} failed: {summary['failure']}", style="bold red", markup=False,
                      highlight=False, soft_wrap=True)
    elif line := ending_line(summary):
        console.print(line, style="bold", markup=False, highlight=False, soft_wrap=True)


def _print_sample(ctx: RunContext, console: Console) -> None:
    try:
        text = sample_text(ctx)
    except (StorageError, ValueError) as err:  # ValueError: the spec's (SpecError) or the run's (RunError)
        console.print(f"(no sample: {err})")
        return
    if text is None:  # the spec has no sample
        return
    console.print("[bold]Sampled from the final model:[/bold]")
    console.print(text, markup=False, highlight=False)


def unmerged_lines(rows: list[dict], bound: int, ended: bool = False) -> list[str]:
    """A line naming the learners with deltas shipped and not decided yet by the version they hold (their
    status's `unmerged`), when any has; none when every one's merged (a merger keeping up). In a live run a
    learner whose own loop has ended is left out (its count is as old as its last beat). `ended`: the run is
    over, so they are the deltas it ended without merging."""
    waiting = [f"{r['learner']} {r['unmerged']}" for r in rows
               if r.get("unmerged") and (ended or r.get("state") not in FINAL_STATES)]
    if not waiting:
        return []
    if ended:
        return [f"deltas the run ended without merging: {', '.join(waiting)}"]
    held = (f" (learner.max_unmerged {bound} per chain: a learner at it trains on and ships the progress "
            "later)"
            if bound else "")
    return [f"deltas not merged yet: {', '.join(waiting)}{held}"]


def print_status(storage: str, run_id: str, json_out: bool) -> None:
    ctx = open_run(open_store(storage), run_id)
    state = read_run_state(ctx)
    rows = learner_status(ctx)
    from diloco.trust.view import trust_lines, trust_summary

    trust = trust_summary(ctx)
    bad = [f"not a version: {line}" for line in chain_report(ctx)]  # a stray or forged manifest key, named
    if json_out:
        for r in rows:
            r["state"] = learner_word(r.get("state"), ctx.store.exists(ctx.keys.removed(r["learner"])), state)
        typer.echo(json.dumps({"run_id": run_id, "latest_version": state.version, "state": state.word,
                               "title": state.title(), "learners": rows, "trust": trust,
                               "manifest_problems": bad}))
        return
    Console().print(progress_table(ctx, None, state))
    future = [f"{r['learner']} ({r['ahead_s']:.0f}s ahead of this clock)" for r in rows if "ahead_s" in r]
    lines = [f"heartbeats from the future, ignored: {', '.join(future)}"] if future else []
    lines = [*bad, *unmerged_lines(rows, ctx.cfg.learner.max_unmerged, state.ended), *lines,
             *trust_lines(trust)]
    for line in lines:
        Console().print(line, markup=False, highlight=False)

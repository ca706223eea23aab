"""The benchmark harness: a benchmark is one function that returns a `BenchResult` (its JSON and the tables
that show it); the harness owns what every benchmark shares (`--json`, `--quick`, `--config`) and the output.

Contract: this module imports only the standard library (the CLI reads `COMMANDS` and a benchmark's options
without importing torch); a benchmark's own options are its function's parameters, each
`Annotated[type, Opt(...)]` with its default; `@benchmark(...)` says which shared options it takes.
`BenchResult.show(json_path)` prints every table and note, then writes the JSON (indent 2) where asked.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# `diloco bench <name>`: the module and the function of each benchmark, in --help's order
COMMANDS = {
    "codec": "codec:bench_codec",
    "goodput": "goodput:bench_goodput",
    "quality": "quality:bench_quality",
    "wan": "wan:bench_wan",
    "merge": "merge:bench_merge",
    "poll": "poll:bench_poll",
    "scale": "scale:bench_scale",
    "outage": "outage:bench_outage",
    "ranks": "ranks:bench_ranks",
    "startup": "startup:bench_startup",
    "moments": "moments:bench_moments",
    "size": "size:bench_size",
}
TOP_COMMANDS = {"bandwidth": "bandwidth:bandwidth"}  # `diloco <name>`: a benchmark at the top level
JSON_HELP = "Write results as JSON here."
CONFIG_HELP = "Recipe name or YAML path."
PROGRESS = "progress"  # a benchmark's parameter of this name receives `show` of its partial results


class Opt:
    """One option of a benchmark: its flags (`"--steps"`, or `"--peer/--no-peer"` for a switch), its help
    and, for numbers, its bounds. The CLI turns it into a typer option; the default is the parameter's."""

    def __init__(self, *flags: str, help: str, min: float | None = None, max: float | None = None,
                 metavar: str | None = None) -> None:
        if not flags:
            raise ValueError("an option needs at least one flag")
        self.flags, self.help, self.min, self.max, self.metavar = flags, help, min, max, metavar


@dataclass
class Table:
    """A table as the terminal shows it: the first `labels` columns left-aligned, the rest right-aligned;
    a row of None starts a new section."""

    title: str
    columns: list[str]
    rows: list[list[str] | None] = field(default_factory=list)
    labels: int = 0


@dataclass
class BenchResult:
    """What a benchmark found: `data` is the JSON (its keys are the contract), `tables` and `notes` (lines
    printed after the tables) show it."""

    data: dict[str, Any]
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def show(self, json_path: Path | None = None) -> None:
        """Print the tables and notes; write the JSON to `json_path` when given (its folder is created)."""
        from rich.console import Console
        from rich.table import Table as RichTable

        console = Console()
        for table in self.tables:
            out = RichTable(title=table.title)
            for i, column in enumerate(table.columns):
                out.add_column(column, justify="left" if i < table.labels else "right")
            for row in table.rows:
                if row is None:
                    out.add_section()
                else:
                    out.add_row(*row)
            console.print(out)
        for note in self.notes:
            console.print(note, markup=False)
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(self.data, indent=2) + "\n")


@dataclass(frozen=True)
class Benchmark:
    """A benchmark function and the shared options it takes (None: not this one's)."""

    fn: Callable[..., BenchResult]
    quick: str | None = None  # the help of --quick
    config: str | None = None  # the default of --config
    config_help: str = CONFIG_HELP
    json_help: str = JSON_HELP

    @property
    def options(self) -> dict[str, tuple[type, Opt, Any]]:
        """The function's own options: parameter name -> (type, Opt, default), in its order."""
        hints = inspect.get_annotations(self.fn, eval_str=True)
        out = {}
        for name, param in inspect.signature(self.fn).parameters.items():
            if name in ("config", "quick", PROGRESS):
                continue
            kind, opt = hints[name].__origin__, hints[name].__metadata__[0]
            if not isinstance(opt, Opt) or param.default is inspect.Parameter.empty:
                raise TypeError(f"{self.fn.__name__}({name}): a benchmark option is Annotated[type, Opt] = "
                                "default")
            out[name] = (kind, opt, param.default)
        return out

    def run(self, json_path: Path | None = None, **kwargs: Any) -> BenchResult:
        """Run the benchmark with these options and show its result (and its partial results, if it has)."""
        if PROGRESS in inspect.signature(self.fn).parameters:
            kwargs[PROGRESS] = lambda partial: partial.show(json_path)
        result = self.fn(**kwargs)
        result.show(json_path)
        return result


def benchmark(*, quick: str | None = None, config: str | None = None, config_help: str = CONFIG_HELP,
              json_help: str = JSON_HELP) -> Callable[[Callable[..., BenchResult]], Callable[...,
                                                                                             BenchResult]]:
    """Mark a function as a benchmark: `quick` (the help of `--quick`), `config` (the default recipe of
    `--config`) when it takes them, as parameters of those names."""

    def mark(fn: Callable[..., BenchResult]) -> Callable[..., BenchResult]:
        fn.benchmark = Benchmark(fn, quick, config, config_help, json_help)  # type: ignore[attr-defined]
        return fn

    return mark


def load(target: str) -> Benchmark:
    """The benchmark of a `COMMANDS` entry ("module:function"), its module imported now."""
    module, name = target.split(":")
    return getattr(importlib.import_module(f"diloco.bench.{module}"), name).benchmark

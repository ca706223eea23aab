"""`diloco bench ...`, `diloco bandwidth`, `diloco simulate-goodput`: the benchmark commands.

Contract: one loop turns every benchmark of diloco/bench/harness.py's COMMANDS into a typer command: the
shared options (`--json`, `--config`, `--quick`) and the function's own (its `Opt` parameters). A `bench`
command is built when it is asked for (its module, and torch, imported then), so `diloco --help` stays fast.
A benchmark prints a table and writes JSON; a bad option is one line, exit 2.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import click
import typer
from typer.core import TyperGroup

from diloco.bench.harness import COMMANDS, TOP_COMMANDS, Benchmark, load
from diloco.cli.errors import user_errors


def command_of(bench: Benchmark) -> Any:
    """The typer callback of a benchmark: its options as typer options, in the order --help shows them."""
    params = [_param("json_path", Path | None, typer.Option(None, "--json", help=bench.json_help))]
    if bench.config is not None:
        params.append(_param("config", str, typer.Option(bench.config, "--config", help=bench.config_help)))
    if bench.quick is not None:
        params.append(_param("quick", bool, typer.Option(False, "--quick", help=bench.quick)))
    for name, (kind, opt, default) in bench.options.items():
        bounds = {k: v for k, v in (("min", opt.min), ("max", opt.max)) if v is not None}
        params.append(_param(name, kind, typer.Option(default, *opt.flags, help=opt.help, metavar=opt.metavar,
                                                      **bounds)))

    def run(**kwargs: Any) -> None:
        with user_errors():
            bench.run(**kwargs)

    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    run.__doc__ = bench.fn.__doc__
    return run


def _param(name: str, kind: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)


class Benchmarks(TyperGroup):
    """`diloco bench`: every name of COMMANDS, each command built from its benchmark when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        if cmd_name not in self.commands:
            one = typer.Typer(add_completion=False, rich_markup_mode=None)
            one.command(cmd_name)(command_of(load(COMMANDS[cmd_name])))
            self.commands[cmd_name] = typer.main.get_command(one)
        return self.commands[cmd_name]


bench = typer.Typer(cls=Benchmarks, no_args_is_help=True,
                    help="Benchmarks: each prints a table and can write JSON.")
app = typer.Typer()
for name, target in TOP_COMMANDS.items():  # at the top level: built now (their modules import no torch)
    app.command(name)(command_of(load(target)))


@app.command("simulate-goodput")
def _simulate_goodput(
    json_path: Path | None = typer.Option(None, "--json", help="Write the table as JSON here."),
    plot_path: Path | None = typer.Option(None, "--plot", help="Write a PNG of goodput against chips here."),
    mtbf_years: float = typer.Option(1.0, "--mtbf-years", min=1e-6, help="Per-chip mean time between "
                                                                         "failures."),
    restart_s: float | None = typer.Option(None, "--restart-s", min=0.0, help="Data-parallel restart time."),
    seed: int = typer.Option(0, "--seed", help="Base seed; every cell derives its own."),
    num_failures: int | None = typer.Option(None, "--num-failures", min=1, help="Monte Carlo size per cell."),
    sweep: bool = typer.Option(False, "--sweep", help="Add goodput vs per-chip MTBF and vs recovery time."),
) -> None:
    """Goodput of data-parallel, elastic data-parallel and Decoupled DiLoCo at 150k-2.4M chips."""
    from diloco.sim.cli import simulate_goodput  # the simulator's own entry: it prints and writes itself

    with user_errors():
        simulate_goodput(json_path=json_path, plot_path=plot_path, mtbf_years=mtbf_years, restart_s=restart_s,
                         seed=seed, num_failures=num_failures, sweep=sweep)

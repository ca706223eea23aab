"""The `diloco` command line: run a job, run one learner or the merger, inspect, audit, benchmark.

Contract: every bad argument is a clear one-line error naming it (exit 2); nothing is changed.
"""

from __future__ import annotations

import typer

from diloco.bench.codec import bench_codec
from diloco.sim.cli import simulate_goodput

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Decoupled DiLoCo on object storage: learners and an outer merge that only talk to a bucket.",
)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: each prints a table and can write JSON.")
app.add_typer(bench_app, name="bench")

bench_app.command("codec")(bench_codec)
app.command("simulate-goodput")(simulate_goodput)


def main() -> None:  # pragma: no cover - entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

"""Options several commands share, and the help panels that group them by audience (typer only; nothing heavy
is imported here)."""

from __future__ import annotations

import typer

DEFAULT_STORAGE = "file://runs"  # the embedded default: a folder in the current directory
STORAGE = typer.Option(DEFAULT_STORAGE, "--storage",
                       help="Where the run lives: file://DIR, s3://bucket/prefix, any fsspec URL.")
RUN_ID = typer.Option(..., "--run-id", help="The run's id (its folder in the storage).")
PREFECT = typer.Option(False, "--prefect/--no-prefect",
                       help="Run as a Prefect flow reporting to PREFECT_API_URL.")
JSON = typer.Option(False, "--json", help="Print JSON.")

# `diloco --help` lists the commands by audience, in this order (each command names its panel; cli/__init__.py
# prints them; every command of cli/bench.py is a benchmark)
RUN_AND_INSPECT = "Run and inspect"
OPERATE = "Operate a live run"
DEPLOY_AND_SECURITY = "Deploy and security"
BENCHMARKS = "Benchmarks"
PANELS = (RUN_AND_INSPECT, OPERATE, DEPLOY_AND_SECURITY, BENCHMARKS)

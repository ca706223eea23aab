"""CLI entry for the goodput simulator (registered as `diloco simulate-goodput`)."""
# STUB — to be implemented by the simulator work.

from __future__ import annotations

from pathlib import Path

import typer


def simulate_goodput(
    json_path: Path | None = typer.Option(None, "--json", help="Write the table as JSON here."),
) -> None:
    """Goodput of data-parallel, elastic data-parallel and Decoupled DiLoCo at 150k-2.4M chips."""
    raise NotImplementedError

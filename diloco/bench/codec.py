"""`diloco bench codec`: encode/decode throughput and ratio of every codec on a real AdamW delta."""
# STUB — to be implemented by the codec work.

from __future__ import annotations

from pathlib import Path

import typer


def bench_codec(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
) -> None:
    """Encode and decode a realistic AdamW delta with every codec; print a table."""
    raise NotImplementedError

"""`diloco export` and `diloco sample`: a committed version's model, out of the bucket.

Contract: export writes safetensors without the spec's code, or the spec's own format (`--format native`,
e.g. a Hugging Face save_pretrained folder) with it; sample prints what the spec samples; one line, exit 2,
for a bad argument (an unknown run or version, a spec without sample or export).
"""

from __future__ import annotations

from pathlib import Path

import typer

from diloco.cli.errors import user_errors
from diloco.cli.options import RUN_AND_INSPECT, RUN_ID, STORAGE

app = typer.Typer()
VERSION = typer.Option(None, "--version", min=0, help="The committed version (default: the newest).")


@app.command("export", rich_help_panel=RUN_AND_INSPECT)
def export(storage: str = STORAGE, run_id: str = RUN_ID, version: int = VERSION,
           out: Path = typer.Option(..., "--out",
                                    help="The safetensors file (or folder, with --format native)."),
           fmt: str = typer.Option("safetensors", "--format",
                                   help="safetensors (the parameters) or native (the spec's own, e.g. "
                                        "Hugging Face)."),
           ) -> None:
    """Write a committed version's parameters as safetensors, or in the spec's own format."""
    with user_errors():
        from diloco.configs import ConfigError
        from diloco.inspect.model_out import export_native, export_safetensors
        from diloco.run.context import open_run

        if fmt not in ("safetensors", "native"):
            raise ConfigError(f"--format {fmt!r} must be safetensors or native")
        ctx = open_run(storage, run_id)
        path, got = (export_safetensors if fmt == "safetensors" else export_native)(ctx, out, version)
        typer.echo(f"wrote version {got} of run {run_id} to {path}")


@app.command("sample", rich_help_panel=RUN_AND_INSPECT)
def sample(storage: str = STORAGE, run_id: str = RUN_ID, version: int = VERSION,
           prompt: str = typer.Option(None, "--prompt", help="Text to continue (default: the spec's own; the "
                                      "built-in specs: the start of the run's held-out text)."),
           seed: int = typer.Option(None, "--seed", min=0,
                                    help="The sampling seed (default: the spec's, 0)."),
           max_bytes: int = typer.Option(None, "--max-bytes", min=1,
                                         help="At most this many bytes after the prompt "
                                         "(default: the spec's; the built-in GPT: 240).")) -> None:
    """Print text the run's spec samples from a committed version."""
    with user_errors():
        from diloco.inspect.model_out import sample as sample_text
        from diloco.run.context import open_run
        from diloco.training.spec import SpecError

        text = sample_text(open_run(storage, run_id), version, prompt, seed=seed, max_bytes=max_bytes)
        if text is None:
            raise SpecError("the run's spec has no sample(model)")
        typer.echo(text)

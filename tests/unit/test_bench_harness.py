"""The benchmark harness: every `diloco bench` command is built from its benchmark function (the shared
options once, the function's own as its parameters), a result is shown as tables and written as JSON, and
`diloco --help` imports no benchmark.

Run: .venv/bin/pytest tests/unit/test_bench_harness.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from diloco.bench.harness import COMMANDS, TOP_COMMANDS, BenchResult, Opt, Table, benchmark, load
from diloco.cli import app


def test_every_command_is_a_benchmark_with_its_options_declared() -> None:
    for target in (*COMMANDS.values(), *TOP_COMMANDS.values()):
        bench = load(target)
        assert bench.fn.__doc__, target
        for name, (_, opt, _) in bench.options.items():
            assert opt.help and all(flag.startswith("-") for flag in opt.flags), (target, name)


def test_the_bench_group_lists_every_command_with_the_shared_options() -> None:
    group = get_command(app).commands["bench"]
    text = CliRunner().invoke(app, ["bench", "--help"], terminal_width=200).output
    listed = [line.split()[0] for line in text.split("Commands:")[1].splitlines() if line.strip()]
    assert listed == list(COMMANDS)
    for name in ("codec", "quality", "wan", "startup"):
        command = group.get_command(None, name)
        flags = {flag for param in command.params for flag in param.opts}
        bench = load(COMMANDS[name])
        assert "--json" in flags
        assert ("--config" in flags) == (bench.config is not None)
        assert ("--quick" in flags) == (bench.quick is not None)


def test_a_result_is_printed_and_written_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = Table("title", ["n", "label"], [["1", "a"], None, ["2", "b"]])
    result = BenchResult({"rows": [{"n": 1}]}, [table], ["a note"])
    result.show(tmp_path / "sub" / "out.json")
    assert json.loads((tmp_path / "sub" / "out.json").read_text()) == {"rows": [{"n": 1}]}
    out = capsys.readouterr().out
    assert "title" in out and "a note" in out and "label" in out


def test_an_option_without_opt_or_default_is_refused() -> None:
    @benchmark()
    def bad(n: int = 1) -> BenchResult:
        return BenchResult({})

    with pytest.raises((TypeError, AttributeError)):
        bad.benchmark.options  # noqa: B018

    @benchmark(quick="Smoke.")
    def good(quick: bool = False, n: Annotated[int, Opt("--n", help="N.", min=1)] = 2) -> BenchResult:
        return BenchResult({"quick": quick, "n": n})

    assert list(good.benchmark.options) == ["n"]
    assert good.benchmark.run(n=3).data == {"quick": False, "n": 3}


def test_the_top_level_help_imports_no_benchmark() -> None:
    code = ("import sys; from typer.main import get_command; from diloco.cli import app; get_command(app); "
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'diloco.bench.')) "
            "and m not in ('diloco.bench.harness', 'diloco.bench.bandwidth')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

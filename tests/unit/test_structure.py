"""The house keeps its floors: every import goes down a floor (FLOORS, docs/ENGINE.md "The house"), so the
package import graph has no circles — `from diloco import X` counts as an arrow to X; training/ and storage/
import no orchestration (storage no torch at module level); the leaves (chaos, bench) and the entry points
(cli, api, flows, launch) are imported by nothing in the core; typer lives only in cli/; no source file is
over 450 lines; and `import diloco.cli` (what `diloco --help` pays) imports neither torch nor prefect.

Run: .venv/bin/pytest tests/unit/test_structure.py -q
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "diloco"
CORE = {"configs", "storage", "training", "specs", "run", "trust", "learner", "merger", "evaluator",
        "supervise", "inspect", "tasks"}
ENTRIES = {"cli", "api", "flows", "launch"}
LEAVES = {"chaos", "bench"}
MAY_IMPORT_LEAVES = {"cli", "flows", "launch", "chaos", "bench"}
# top to bottom: a package imports only packages on floors below its own (the package's own __init__, with its
# version and the lazy `diloco.train`, is no floor: it is the door, not a room)
FLOORS = (
    {"cli"},
    {"bench", "sim"},  # leaves the CLI runs
    {"api"},  # the Python facade: run, operate, RunSummary
    {"flows"},  # Prefect only
    {"launch", "tasks"},  # the one entry that starts a role; Prefect's task units
    {"chaos"},  # fault injection: a leaf the core never imports
    {"inspect"},  # audit, report, summary, gc, plot
    {"learner", "merger", "evaluator", "supervise"},  # the roles and their supervisor
    {"trust"},  # signing, guard, judge, validation, outliers, bucket policies
    {"run"},  # a run's context, life and objects
    {"specs"},  # the shipped TrainSpecs
    {"training", "storage"},  # pure PyTorch; the bucket
    {"configs"},
)
MAX_LINES = 450


def package_of(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def rooms() -> set[str]:
    """The packages and top-level modules of diloco/."""
    return {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {
        p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}


ROOMS = rooms()


def imports_of(source: str, where: str = "<source>") -> set[str]:
    """Every module (absolute imports only: the project uses no relative ones) a source imports, at any depth
    (an import inside a function is an arrow too); `from diloco import X` is diloco.X when X is a room, else
    diloco."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{where}: relative import"
            # `from diloco import api`: an arrow to api (`__version__`: to the door)
            if node.module == "diloco":
                names.update(f"diloco.{a.name}" if a.name in ROOMS else "diloco" for a in node.names)
            else:
                names.add(node.module or "")
    return names


def imports() -> dict[Path, set[str]]:
    """imports_of every source file of diloco/."""
    return {path: imports_of(path.read_text(), str(path)) for path in ROOT.rglob("*.py")}


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path, names in imports().items():
        me = package_of(path)
        for name in names:
            parts = name.split(".")
            if parts[0] == "diloco" and len(parts) > 1 and parts[1] not in (me, "__init__"):
                graph.setdefault(me, set()).add(parts[1])
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_graph_has_no_circles() -> None:
    assert cycles(package_graph()) == []


def test_from_diloco_import_x_is_an_arrow_to_x() -> None:
    """`from diloco import api` inside a function is seen (the circle api -> flows -> operate -> api hid
    there); `from diloco import __version__` is the package's door, no room."""
    source = "def resume():\n    from diloco import api, __version__\n    from diloco.run import context\n"
    assert imports_of(source) == {"diloco.api", "diloco", "diloco.run"}


def test_every_package_is_on_a_floor_and_every_import_goes_down() -> None:
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}
    assert sorted(ROOMS - set(floor)) == [], "a new room: give it a floor in FLOORS (and docs/ENGINE.md)"
    up = [f"{a} -> {b}" for a, bs in package_graph().items() if a != "__init__"
          for b in bs if floor[b] <= floor[a]]
    assert up == []


def test_training_and_storage_import_no_orchestration() -> None:
    graph = package_graph()
    assert graph.get("training", set()) <= {"configs"}, graph.get("training")
    assert graph.get("storage", set()) <= {"configs"}, graph.get("storage")
    # at module level: the codec's bf16 cast borrows torch's rounding inside one function, and nothing else
    torch_in_storage = [p for p in ROOT.joinpath("storage").rglob("*.py")
                        for node in ast.parse(p.read_text()).body
                        if isinstance(node, ast.Import | ast.ImportFrom)
                        and "torch" in {a.name.split(".")[0] for a in node.names}
                        | {(getattr(node, "module", "") or "").split(".")[0]}]
    assert torch_in_storage == []


def test_the_core_imports_no_leaf_and_no_entry_point() -> None:
    bad = [f"{a} -> {b}" for a, bs in package_graph().items() for b in bs
           if (a in CORE and b in LEAVES | ENTRIES) or (b in LEAVES and a not in MAY_IMPORT_LEAVES)]
    assert bad == []


def test_typer_lives_only_in_the_cli() -> None:
    users = [str(p.relative_to(ROOT)) for p, names in imports().items()
             if package_of(p) != "cli" and any(n.split(".")[0] == "typer" for n in names)]
    assert users == []


def test_no_source_file_is_over_the_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := p.read_text().count("\n")) > MAX_LINES}
    assert long == {}


def test_the_command_line_imports_neither_torch_nor_prefect() -> None:
    code = "import sys, diloco.cli; print(sorted(m for m in ('torch', 'prefect') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=True)
    assert done.stdout.strip() == "[]"

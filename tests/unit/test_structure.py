"""The house keeps its floors: the package import graph has no circles; training/ and storage/ import no
orchestration (storage no torch at module level); the leaves (chaos, bench) and the entry points (cli, flows, launch,
api, zygote) are imported by nothing in the core; typer lives only in cli/; no source file is over 450 lines;
and `import diloco.cli` (what `diloco --help` pays) imports neither torch nor prefect.

Run: .venv/bin/pytest tests/unit/test_structure.py -q
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "diloco"
CORE = {"configs", "storage", "training", "run", "learner", "merger", "supervise", "inspect", "tasks", "errors"}
ENTRIES = {"cli", "flows", "launch", "api", "operate", "zygote"}
LEAVES = {"chaos", "bench"}
MAY_IMPORT_LEAVES = {"cli", "flows", "launch", "chaos", "bench"}
MAX_LINES = 450


def package_of(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def imports() -> dict[Path, set[str]]:
    """Every module (absolute imports only: the project uses no relative ones) each source file imports."""
    found: dict[Path, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import"
                names.add(node.module or "")
        found[path] = names
    return found


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


def test_training_and_storage_import_no_orchestration() -> None:
    graph = package_graph()
    assert graph.get("training", set()) <= {"configs"}, graph.get("training")
    assert graph.get("storage", set()) <= {"configs"}, graph.get("storage")
    # at module level: the codec's bf16 cast borrows torch's rounding inside one function, and nothing else
    torch_in_storage = [p for p in ROOT.joinpath("storage").rglob("*.py")
                        for node in ast.parse(p.read_text()).body
                        if isinstance(node, ast.Import | ast.ImportFrom)
                        and "torch" in {a.name.split(".")[0] for a in node.names} | {(getattr(node, "module", "") or "").split(".")[0]}]
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
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := p.read_text().count("\n")) > MAX_LINES}
    assert long == {}


def test_the_command_line_imports_neither_torch_nor_prefect() -> None:
    code = "import sys, diloco.cli; print(sorted(m for m in ('torch', 'prefect') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"

"""Bad specs and spec inputs: each is one line naming the problem (exit 2 on the command line) and nothing is
created — a module that cannot be imported, a missing attribute, a syntax error, a factory returning something
else, build_model returning no module or no floating-point parameters, a malformed --spec-arg, an empty
corpus, a loss that does not return (tensor, int).

Run: .venv/bin/pytest tests/integration/test_spec_errors.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco import api
from diloco.configs import load_config
from diloco.supervise.user_errors import USER_ERRORS

HEADER = "import torch\nfrom torch import nn\nimport diloco\n"
GOOD = HEADER + '''
def _batches(shard, num_shards, start):
    while True:
        yield torch.ones(2, 3)

def good_loss(model, b):
    return model(b).sum() * 0, 6

def make_spec():
    return diloco.TrainSpec(build_model=lambda: nn.Linear(3, 1), batches=_batches, loss=good_loss)
'''
CASES = {
    "returns_int": ("def make_spec():\n    return 42\n", "returned a int, not a diloco.TrainSpec"),
    "not_a_module": (GOOD.replace("lambda: nn.Linear(3, 1)", "lambda: 'model'"),
                     "returned str, not a torch.nn.Module"),
    "int_params": (GOOD.replace("lambda: nn.Linear(3, 1)", "lambda: Ints()") + '''
class Ints(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)
''', "parameters must be floating point"),
    "bad_loss": (GOOD.replace("return model(b).sum() * 0, 6", "return model(b).sum()"),
                 r"loss must return \(scalar loss tensor, num_tokens: int\)"),
    "bad_tokens": (GOOD.replace("return model(b).sum() * 0, 6", "return model(b).sum(), 2.5"),
                   "num_tokens as an int >= 1"),
    "syntax": ("def make_spec(:\n", "could not be imported: SyntaxError"),
    "no_attr": (HEADER, "has no attribute 'make_spec'"),
}


def _spec(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return f"{path}:make_spec"


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_spec_is_one_error_and_creates_nothing(tmp_path: Path, case: str) -> None:
    source, message = CASES[case]
    store = tmp_path / "runs"
    cfg = load_config("tiny").with_overrides({"spec": _spec(tmp_path, case, source),
                                              "run.storage": f"file://{store}"})
    with pytest.raises(USER_ERRORS, match=message):
        api.create(cfg, "bad")
    assert not store.exists() or not any(store.rglob("*")), "a bad spec created objects"


def test_the_good_spec_of_these_cases_creates_its_run(tmp_path: Path) -> None:
    cfg = load_config("tiny").with_overrides({"spec": _spec(tmp_path, "good", GOOD),
                                              "run.storage": f"file://{tmp_path}/r"})
    ctx = api.create(cfg, "good")
    assert [p["name"] for p in ctx.layout] == ["weight", "bias"]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli", "run", "--config", "tiny", "--no-prefect",
                           "--no-live", "--storage", f"file://{tmp_path}/runs", "--run-id", "bad", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize(("args", "message"), [
    (["--spec", "no_such_module_xyz:make_spec"],
     "spec module 'no_such_module_xyz' could not be imported: ModuleNotFoundError"),
    (["--spec-arg", "hidden"], "--spec-arg 'hidden' must be key=value"),
    (["--corpus", "EMPTY"], "the folder has no files"),
])
def test_the_command_line_says_it_in_one_line_and_exits_2(
        tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "empty").mkdir()
    args = [str(tmp_path / "empty") if a == "EMPTY" else a for a in args]
    done = _run(tmp_path, *args)
    lines = done.stderr.strip().splitlines()
    assert (done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ")
            and message in lines[0]), done.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*"))

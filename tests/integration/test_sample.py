"""`diloco sample`: `--seed` and `--max-bytes` reach the spec's sample by name (one it does not take is one
line, exit 2), and without `--prompt` the built-in GPT continues the start of the run's held-out text, not a
fixed string; and `diloco run` names the data its spec read (a folder's files, those skipped) when it creates
the run.

Run: .venv/bin/pytest tests/integration/test_sample.py -q   (a tiny run's version 0, a few seconds)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from diloco.cli import app
from diloco.configs import load_config
from diloco.run.create import create_run
from diloco.specs.text import Corpus, default_prompt
from diloco.storage import open_store


def test_the_default_prompt_is_the_held_out_texts_start_to_a_line_break() -> None:
    held = np.frombuffer(b"# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore. A platform before the castle.\n",
                         dtype=np.uint8)
    # 64 bytes cut after a line break
    assert default_prompt(Corpus(held, held, "t")) == "# Hamlet\n\n## ACT I\n\n"
    assert default_prompt(Corpus(held, held[:7], "t")) == "# Hamle"  # no line break: what there is
    assert default_prompt(Corpus(held, np.frombuffer("é".encode() * 40, dtype=np.uint8), "t")) == "é" * 32


def test_sample_takes_a_seed_and_a_byte_budget_and_prompts_from_the_corpus(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    ctx = create_run(open_store(url), "s", load_config("tiny").with_overrides({"run.num_learners": 1}))

    def sample(*flags: str) -> str:
        result = CliRunner().invoke(app, ["sample", "--storage", url, "--run-id", ctx.run_id, *flags])
        assert result.exit_code == 0, result.output
        return result.output.removesuffix("\n")

    from diloco.specs.gpt import load_corpus

    prompt = default_prompt(load_corpus(ctx.cfg.data))
    first = sample("--seed", "1", "--max-bytes", "12")
    assert first.startswith(prompt) and prompt.startswith("# ") and "ROMEO" not in first, first
    assert 0 < len(first) - len(prompt) <= 12  # bytes decoded: a character is at least one byte
    assert sample("--seed", "1", "--max-bytes", "12") == first  # the same seed, the same text
    assert len(sample("--seed", "1", "--max-bytes", "40")) > len(first)
    assert sample("--seed", "2", "--max-bytes", "40", "--prompt", "ab").startswith("ab")
    bad = CliRunner().invoke(app, ["sample", "--storage", url, "--run-id", ctx.run_id, "--max-bytes", "0"])
    assert bad.exit_code == 2, bad.output


def test_an_option_the_specs_sample_does_not_take_is_refused(monkeypatch) -> None:
    import pytest

    from diloco.inspect import model_out
    from diloco.training.spec import SpecError, TrainSpec

    spec = TrainSpec(build_model=lambda: None, batches=lambda *a: iter(()), loss=lambda *a: (None, 0),
                     sample=lambda model, prompt="x": prompt)
    monkeypatch.setattr(model_out, "load_model", lambda ctx, version: (spec, None, None))
    assert model_out.sample(None, prompt="y") == "y"
    with pytest.raises(SpecError, match="takes no seed"):
        model_out.sample(None, seed=3)


def test_run_creation_names_the_data_the_spec_read(tmp_path: Path, monkeypatch) -> None:
    """The corpus loader's "N files (k skipped: not text)" is printed when the run is created."""
    from diloco import api
    from diloco.cli import view

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(" ".join(f"w{i % 997}" for i in range(20000)))
    (corpus / "b.txt").write_text(" ".join(f"v{i % 991}" for i in range(20000)))
    (corpus / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    monkeypatch.setattr(api, "supervise", lambda ctx, **kw: "target version")
    # the summary: nothing failed
    monkeypatch.setattr(view, "final_report", lambda *a, **k: {"failure": None})
    result = CliRunner().invoke(app, ["run", "--config", "tiny", "--corpus", str(corpus), "--no-prefect",
                                      "--no-live",
                                      "--run-id", "data", "--storage",
                                      f"file://{tmp_path}/bucket"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert f"data: {corpus}: 2 files (1 skipped: not text)" in " ".join(result.output.split()), result.output

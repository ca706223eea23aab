"""Your model, out, and the Hugging Face spec: a committed version exported as safetensors and loaded into a
fresh model gives the run's recorded held-out loss; the Hugging Face spec (a tiny Llama from a config, a BPE
tokenizer trained on the run's text and stored in the bucket) trains for a few versions on CPU, its loss
falls, and its save_pretrained export loads with transformers' from_pretrained to the same loss.

Run: .venv/bin/pytest tests/integration/test_export_and_hf.py   (about a minute on 2 cores)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from diloco.cli import app
from diloco.configs import load_config
from diloco.evaluator.evaluator import Evaluator, read_evals
from diloco.learner.learner import Learner
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.run.spec import load_run_spec
from diloco.storage import open_store
from diloco.training.inner import evaluate

pytestmark = pytest.mark.slow


def train_versions(ctx, rounds: int) -> list[dict]:
    """Every learner a phase, then a merge, `rounds` times; the evaluator scores every version."""
    learners = [Learner(ctx, name) for name in ctx.learners]
    for learner in learners:
        learner.join()
    merger, evaluator = Merger(ctx), Evaluator(ctx)
    merger.load()
    evaluator.evaluate_version(0)
    for _ in range(rounds):
        for learner in learners:
            learner.maybe_install()
            learner.publish(learner.run_phase())
            learner.publisher.drain()
        merger.merge_once()
        evaluator.evaluate_version(merger.version)
    for learner in learners:
        learner.close()
    return read_evals(ctx)


def test_a_safetensors_export_loads_back_to_the_recorded_loss(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from diloco.training.model import build_model, set_params

    cfg = load_config("tiny").with_overrides({"run.num_learners": 2, "learner.local_state_every_steps": 0})
    url = f"file://{tmp_path}/store"
    ctx = create_run(open_store(url), "exp", cfg)
    evals = train_versions(ctx, 3)
    out = tmp_path / "out" / "model.safetensors"
    result = CliRunner().invoke(app, ["export", "--storage", url, "--run-id", "exp", "--out", str(out)])
    assert result.exit_code == 0 and "wrote version 3" in result.output, result.output
    # another init: only the export's tensors make it the run's model
    fresh = build_model(cfg.model, seed=999)
    set_params(fresh, load_file(out))
    spec = load_run_spec(ctx)
    assert evaluate(fresh, spec.eval_batches(), loss=spec.loss) == pytest.approx(evals[-1]["loss"], abs=1e-6)
    bad = CliRunner().invoke(app, ["export", "--storage", url, "--run-id", "exp", "--version", "9", "--out",
                                   str(out)])
    assert bad.exit_code == 2 and "no committed version 9" in bad.output


def test_the_hugging_face_spec_trains_and_exports_for_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}.\n"
                            for i in range(2500)))
    cfg = load_config("tiny").with_overrides({
        "spec": "diloco.specs.hf:make_spec", "data.corpus": str(text), "run.num_learners": 2,
        "spec_args": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                      "num_attention_heads": 2,
                      "num_key_value_heads": 1, "seq_len": 32, "batch_size": 4, "vocab_size": 300},
        "learner.local_state_every_steps": 0, "inner.steps_per_phase": 10,
    })
    url = f"file://{tmp_path}/store"
    ctx = create_run(open_store(url), "hf", cfg)
    assert ctx.store.exists(ctx.keys.spec_file("tokenizer.json"))  # every learner reads this one
    assert [p["name"] for p in ctx.layout if p["direct"]] == ["model.embed_tokens.weight"]
    evals = train_versions(ctx, 4)
    assert evals[0]["metric"] == "nats/token" and evals[-1]["loss"] < evals[0]["loss"] - 0.5, evals
    out = tmp_path / "hf-model"
    result = CliRunner().invoke(app, ["export", "--storage", url, "--run-id", "hf", "--format", "native",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    loaded = AutoModelForCausalLM.from_pretrained(out)
    spec = load_run_spec(ctx)
    with torch.no_grad():
        assert evaluate(loaded, spec.eval_batches(),
                        loss=spec.loss) == pytest.approx(evals[-1]["loss"], abs=1e-5)
    sampled = CliRunner().invoke(app, ["sample", "--storage", url, "--run-id", "hf", "--prompt", "line 3"])
    assert sampled.exit_code == 0 and sampled.output.startswith("line 3"), sampled.output

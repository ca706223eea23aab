"""A Hugging Face `transformers` causal LM built from a config (no weights downloaded) on a text corpus, with
a byte-level tokenizer or a BPE one trained locally on the run's training text (`pip install 'diloco[hf]'`).

Contract: `make_spec(run_config, files, **spec_args)`: the model is `AutoModelForCausalLM.from_config` of
`model_type` (default llama) with the given sizes; the tokenizer is trained once, by the run's creator, with
the `tokenizers` library, and stored in the run's spec files (`tokenizer.json`), so every learner and the
evaluator tokenize alike; batches are `batch_size` random windows of `seq_len` tokens from the learner's
contiguous shard of the training tokens, or from all of them (`data.sampling`; batch i a pure function of
(data.seed, shard, i)); loss is the model's own (labels = inputs, shifted inside), `batch_size * (seq_len -
1)` tokens; the held-out metric is nats per token on fixed windows of the held-out text; `export` writes a
`save_pretrained` folder (model and tokenizer) that `transformers` loads with `from_pretrained`. The corpus
comes from `data.*` as for the GPT.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.configs import Config
from diloco.specs.text import default_prompt, load_text
from diloco.training.spec import SpecError, TrainSpec

MAX_POSITIONS = 256  # rotary positions: no parameters; a sample's prompt + continuation fits in it
EOT = "<|endoftext|>"  # the one special token: id 0, also BOS/EOS of the model
QUIET = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
         # no hub: these machines cannot reach one
         "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _tokenizers():
    try:
        import tokenizers
        import transformers  # noqa: F401
    except ImportError:
        raise SpecError("the Hugging Face spec needs transformers and tokenizers: pip install "
                        "'diloco[hf]'") from None
    return tokenizers


def train_tokenizer(text: bytes, kind: str, vocab_size: int) -> str:
    """A tokenizer as JSON (tokenizers' to_str): byte-level BPE trained on `text`, or bytes only ("byte")."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    size = 256 + 1 if kind == "byte" else vocab_size  # "byte": the alphabet and EOT, no merges
    trainer = tk.trainers.BpeTrainer(vocab_size=size, min_frequency=2, special_tokens=[EOT],
                                     show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    lines = text.decode("utf-8", errors="replace").split("\n")
    tok.train_from_iterator(lines if kind == "bpe" else [], trainer=trainer)
    return tok.to_str()


def _ids(tok: Any, data: np.ndarray) -> np.ndarray:
    text = data.tobytes().decode("utf-8", errors="replace").replace(EOT, "")  # the special string is not text
    return np.asarray(tok.encode(text).ids, dtype=np.int64)


def _windows(ids: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> torch.Tensor:
    starts = rng.integers(0, len(ids) - seq_len, size=batch)
    return torch.from_numpy(ids[starts[:, None] + np.arange(seq_len)])  # (B, T)


def _build_model(model_type: str, vocab: int, eot: int, sizes: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(model_type, vocab_size=vocab, bos_token_id=eot, eos_token_id=eot,
                                      **sizes)
    except (ValueError, TypeError) as err:
        raise SpecError(f"Hugging Face config {model_type!r}: {err}") from None
    return AutoModelForCausalLM.from_config(config)


def make_spec(run_config: Config, files: Any = None, *, model_type: str = "llama", hidden_size: int = 64,
              intermediate_size: int = 128, num_hidden_layers: int = 2, num_attention_heads: int = 4,
              num_key_value_heads: int = 2, tie_word_embeddings: bool = True, seq_len: int = 64,
              batch_size: int = 8, tokenizer: str = "bpe", vocab_size: int = 1024,
              prompt: str | None = None) -> TrainSpec:
    """A tiny Llama by default; every size is a spec argument (`--spec-arg hidden_size=128`); `prompt`: a
    sample's default (None: the start of the held-out text)."""
    for name, value in QUIET.items():
        os.environ.setdefault(name, value)
    tk = _tokenizers()
    if tokenizer not in ("bpe", "byte"):
        raise SpecError(f"spec_args.tokenizer {tokenizer!r} must be bpe or byte")
    if seq_len < 2 or batch_size < 1:
        raise SpecError(f"spec_args: seq_len ({seq_len}) must be >= 2 and batch_size ({batch_size}) >= 1")
    cfg = run_config
    text = load_text(cfg.data.corpus, cfg.data.heldout, cfg.data.text_field)
    stored = files.get("tokenizer.json") if files is not None else None
    if stored is None:
        stored = train_tokenizer(text.train.tobytes(), tokenizer, vocab_size).encode()
        stored = files.put("tokenizer.json", stored) if files is not None else stored
    tok = tk.Tokenizer.from_str(stored.decode())
    eot = tok.token_to_id(EOT)
    train_ids, held_ids = _ids(tok, text.train), _ids(tok, text.heldout)
    for part, ids in (("train", train_ids), ("held-out", held_ids)):
        if len(ids) <= seq_len:
            raise SpecError(f"the {part} text has {len(ids)} tokens: fewer than seq_len + 1 = {seq_len + 1}")
    sizes = dict(hidden_size=hidden_size, intermediate_size=intermediate_size,
                 num_hidden_layers=num_hidden_layers,
                 num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                 max_position_embeddings=max(seq_len, MAX_POSITIONS), tie_word_embeddings=tie_word_embeddings)

    def batches(shard: int, num_shards: int, start: int) -> Iterator[torch.Tensor]:
        n = len(train_ids)
        mine = (train_ids if cfg.data.sampling == "whole"
                else train_ids[shard * n // num_shards:(shard + 1) * n // num_shards])
        if len(mine) <= seq_len:
            raise SpecError(f"shard {shard}/{num_shards} has {len(mine)} tokens, fewer than seq_len + 1")
        i = start
        while True:
            yield _windows(mine, np.random.default_rng([cfg.data.seed % 2**63, shard, i]), batch_size,
                           seq_len)
            i += 1

    def loss(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        return model(input_ids=batch, labels=batch).loss, batch.shape[0] * (batch.shape[1] - 1)

    def eval_batches() -> list[torch.Tensor]:
        rng = np.random.default_rng([cfg.data.seed % 2**63, 1 << 20])
        return [_windows(held_ids, rng, cfg.eval.batch_size, seq_len) for _ in range(cfg.eval.num_batches)]

    def sample(model: torch.nn.Module, prompt: str = default_prompt(text) if prompt is None else prompt,
               max_new_tokens: int = 60, seed: int = 0, max_bytes: int | None = None) -> str:
        ids = torch.tensor([tok.encode(prompt).ids[-MAX_POSITIONS // 2:]], dtype=torch.long)
        if max_bytes is not None:  # a token is at least one byte
            max_new_tokens = min(max_new_tokens, max_bytes)
        max_new_tokens = min(max_new_tokens, MAX_POSITIONS - ids.shape[1])
        torch.manual_seed(seed)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, pad_token_id=eot)
        new = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=False)
        if max_bytes is not None:
            new = new.encode()[:max_bytes].decode("utf-8", errors="ignore")
        return tok.decode(ids[0].tolist(), skip_special_tokens=False) + new

    def export(model: torch.nn.Module, folder: Path) -> None:
        from transformers import PreTrainedTokenizerFast

        model.save_pretrained(folder)
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT).save_pretrained(folder)

    return TrainSpec(build_model=lambda: _build_model(model_type, tok.get_vocab_size(), eot, sizes),
                     batches=batches, loss=loss, eval_batches=eval_batches, sample=sample,
                     metric_name="nats/token", export=export, data_source=text.source)

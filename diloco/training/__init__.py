"""Pure PyTorch training pieces: model, data, inner AdamW loop, outer Nesterov step, merge rules.

Contract: imports neither Prefect nor fsspec; everything here is deterministic given its seeds.
"""

from diloco.training.data import Corpus, DataError, ShardSampler, eval_batches, load_corpus, shard_of
from diloco.training.inner import InnerTrainer, evaluate, lr_at
from diloco.training.merge import Combiner, delta_weight
from diloco.training.model import (
    GPT,
    build_model,
    get_flat_params,
    model_fingerprint,
    param_names,
    set_params,
)
from diloco.training.outer import nesterov_step

__all__ = [
    "GPT",
    "Combiner",
    "Corpus",
    "DataError",
    "InnerTrainer",
    "ShardSampler",
    "build_model",
    "delta_weight",
    "eval_batches",
    "evaluate",
    "get_flat_params",
    "load_corpus",
    "lr_at",
    "model_fingerprint",
    "nesterov_step",
    "param_names",
    "set_params",
    "shard_of",
]

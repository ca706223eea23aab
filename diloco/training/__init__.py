"""Pure PyTorch training pieces: the TrainSpec contract, model, data, inner loop, outer optimizer, merge
rules.

Contract: imports neither Prefect nor fsspec; everything here is deterministic given its seeds.
"""

from diloco.training.data import DataError, ShardSampler, eval_batches, shard_of
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
from diloco.training.outer import OuterOptimizer, OuterState, OuterUpdate, nesterov_step
from diloco.training.spec import SpecError, TrainSpec

__all__ = [
    "GPT",
    "Combiner",
    "DataError",
    "InnerTrainer",
    "OuterOptimizer",
    "OuterState",
    "OuterUpdate",
    "ShardSampler",
    "SpecError",
    "TrainSpec",
    "build_model",
    "delta_weight",
    "eval_batches",
    "evaluate",
    "get_flat_params",
    "lr_at",
    "model_fingerprint",
    "nesterov_step",
    "param_names",
    "set_params",
    "shard_of",
]

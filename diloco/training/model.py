"""A small GPT: pre-LN blocks, causal scaled-dot-product attention, tied embeddings, bytes in.

Contract: pure PyTorch; `param_names()` order is stable and defines every delta's tensor order.
"""
# STUB — to be implemented.

from __future__ import annotations

import torch
from torch import nn

from diloco.configs import ModelConfig


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        raise NotImplementedError

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, T) int64 -> logits (B, T, V); with targets also the mean cross-entropy (nats/token)."""
        raise NotImplementedError

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None) -> torch.Tensor:
        raise NotImplementedError


def build_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    """Deterministic init from the seed (the initial global version 0)."""
    raise NotImplementedError


def model_fingerprint(model: nn.Module, cfg: ModelConfig) -> str:
    """Stable hash of parameter names, shapes and the model config."""
    raise NotImplementedError


def get_flat_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> fp32 CPU clone of each parameter (tied weights appear once), in param order."""
    raise NotImplementedError


def set_params(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy the given tensors into the model's parameters (dtype/device converted)."""
    raise NotImplementedError

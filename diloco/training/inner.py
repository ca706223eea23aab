"""The inner loop: AdamW with warmup + cosine, gradient clipping, and held-out evaluation.

Contract: pure PyTorch; optimizer state exports to plain tensors + JSON (no pickle) and back.
"""
# STUB — to be implemented.

from __future__ import annotations

import torch
from torch import nn

from diloco.configs import InnerConfig


def lr_at(step: int, cfg: InnerConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, cosine to min_lr_ratio*lr at total_steps, flat after."""
    raise NotImplementedError


class InnerTrainer:
    """One learner's model + AdamW. `step` counts inner steps done (drives the schedule)."""

    def __init__(self, model: nn.Module, cfg: InnerConfig, device: str = "cpu", step: int = 0) -> None:
        raise NotImplementedError

    step: int

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One AdamW step on (x, y); returns the training loss (nats/token). Uses bf16 autocast on CUDA."""
        raise NotImplementedError

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, json-able meta) of the optimizer state and step — for a pickle-free checkpoint."""
        raise NotImplementedError

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        raise NotImplementedError


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: str = "cpu") -> float:
    """Mean cross-entropy over the batches, nats per byte."""
    raise NotImplementedError

"""The inner loop: AdamW with warmup + cosine, gradient clipping, and held-out evaluation.

Contract: pure PyTorch; optimizer state exports to plain tensors + JSON (no pickle) and back.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from diloco.configs import InnerConfig

STATE_FORMAT = 1  # version of the export_state layout
STATE_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter tensors


def lr_at(step: int, cfg: InnerConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, cosine to min_lr_ratio*lr at total_steps, flat after.

    Step s (0-based) of the warmup uses lr * (s + 1) / warmup_steps, so step 0 already learns.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    min_lr = cfg.lr * cfg.min_lr_ratio
    if step >= cfg.total_steps:
        return min_lr
    progress = (step - cfg.warmup_steps) / max(cfg.total_steps - cfg.warmup_steps, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


def _autocast(device: str) -> contextlib.AbstractContextManager:
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class InnerTrainer:
    """One learner's model + AdamW. `step` counts inner steps done (drives the schedule).

    Weight decay applies to >= 2-D parameters only. The model is moved to `device`.
    """

    def __init__(self, model: nn.Module, cfg: InnerConfig, device: str = "cpu", step: int = 0) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.model = model.to(device)
        self.cfg = cfg
        self.device = device
        self.step = step
        self.last_grad_norm = 0.0  # before clipping, of the last train_step
        self.named = dict(model.named_parameters())  # tied weights once, stable order
        decay = [p for p in self.named.values() if p.dim() >= 2]
        no_decay = [p for p in self.named.values() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr_at(step, cfg), betas=(cfg.beta1, cfg.beta2),
        )

    @property
    def lr(self) -> float:
        """The learning rate the next train_step will use."""
        return lr_at(self.step, self.cfg)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One AdamW step on (x, y); returns the training loss (nats/token). Uses bf16 autocast on CUDA.

        A non-finite loss raises FloatingPointError before any parameter changes.
        """
        self.model.train()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with _autocast(self.device):
            _, loss = self.model(x, y)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"inner step {self.step}: loss is {loss_value}")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(self.named.values()), self.cfg.grad_clip)
        self.last_grad_norm = float(norm)
        lr = lr_at(self.step, self.cfg)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.step += 1
        return loss_value

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, json-able meta) of the optimizer state and step — for a pickle-free checkpoint.

        tensors: "exp_avg/<param>" and "exp_avg_sq/<param>" (fp32, CPU) for every parameter that
        has state; meta: {"format", "step", "param_steps": {param: AdamW step count}}.
        """
        tensors: dict[str, torch.Tensor] = {}
        param_steps: dict[str, int] = {}
        for name, p in self.named.items():
            state = self.opt.state.get(p)
            if not state:
                continue
            param_steps[name] = int(float(state["step"]))
            for key in STATE_KEYS:
                tensors[f"{key}/{name}"] = state[key].detach().to("cpu", torch.float32).clone()
        return tensors, {"format": STATE_FORMAT, "step": self.step, "param_steps": param_steps}

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore what export_state gave, so training continues bit for bit.

        Raises ValueError (and changes nothing) on an unknown format, name or shape.
        """
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"optimizer state format {meta.get('format')!r}, expected {STATE_FORMAT}")
        step, param_steps = meta.get("step"), meta.get("param_steps", {})
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"optimizer state meta: step must be an int >= 0, got {step!r}")
        new_state = {}
        for name, count in param_steps.items():
            if name not in self.named:
                raise ValueError(f"optimizer state names unknown parameter {name!r}")
            p = self.named[name]
            entry = {"step": torch.tensor(float(count), dtype=torch.get_default_dtype())}
            for key in STATE_KEYS:
                t = tensors.get(f"{key}/{name}")
                if t is None or tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {key}/{name}: missing or shape differs from {tuple(p.shape)}")
                entry[key] = t.detach().to(device=p.device, dtype=p.dtype).clone()
            new_state[p] = entry
        self.opt.state.clear()
        self.opt.state.update(new_state)
        self.step = step
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: str = "cpu") -> float:
    """Mean cross-entropy over the batches, nats per byte (model.eval(); the mode is restored)."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for x, y in batches:
            with _autocast(device):
                _, loss = model(x.to(device), y.to(device))
            total += loss.item() * y.numel()
            count += y.numel()
    finally:
        model.train(was_training)
    return total / count

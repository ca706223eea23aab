"""A small GPT: pre-LN blocks, causal scaled-dot-product attention, tied embeddings, bytes in.

Contract: pure PyTorch; `param_names()` order is stable and defines every delta's tensor order.
"""

from __future__ import annotations

import hashlib
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

from diloco.configs import ModelConfig

INIT_STD = 0.02  # GPT-2's init; residual projections get INIT_STD / sqrt(2 * n_layer)
EMBEDDING_PARAMS = ("wte.weight", "wpe.weight")  # token (tied with lm_head) and position embeddings


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)  # residual projection

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`cache` (generation): this layer's keys and values of the positions before x, extended in place;
        x's positions attend to all of them."""
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            if cache:
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)  # (B, nh, past+T, hs)
            cache[:] = [k, v]
        p = self.dropout if self.training else 0.0
        # causal when x is the whole sequence; one new position with a cache sees every key
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=T > 1)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)  # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), cache))  # (B, T, C)
        return x + self.drop(self.mlp(self.ln2(x)))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)  # token embedding, tied with lm_head
        self.wpe = nn.Embedding(cfg.ctx_len, cfg.d_model)  # learned positions
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: named_parameters() lists it once, as wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, T) int64 -> logits (B, T, V); with targets also the mean cross-entropy (nats/token)."""
        B, T = idx.shape
        logits = self.lm_head(self.ln_f(self._trunk(idx)))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss

    def next_logits(self, idx: torch.Tensor, caches: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
        """The logits (B, V) after idx (B, T): only the last position through the head. `caches` (one list per
        block, empty at first): idx holds only the positions after the cached ones, whose keys and values are
        kept, so each new byte costs one position, not the whole context."""
        return self.lm_head(self.ln_f(self._trunk(idx, caches)[:, -1, :]))  # (B, V)

    def _trunk(self, idx: torch.Tensor, caches: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
        """idx (B, T) -> the last block's output (B, T, C), at positions after the cached ones (see
        next_logits)."""
        past = caches[0][0].size(2) if caches and caches[0] else 0
        T = idx.size(1)
        if past and T > 1:  # the attention's causal mask would not be offset by the cached positions
            raise ValueError("next_logits takes one position at a time once keys and values are cached, got "
                             f"{T}")
        if self.cfg.ctx_len < past + T:
            raise ValueError(f"sequence length {past + T} exceeds model.ctx_len {self.cfg.ctx_len}")
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(past, past + T, device=idx.device)))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])  # (B, T, C)
        return x

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append max_new_tokens sampled bytes to idx (B, T); the context is cropped to ctx_len. Keys and
        values are cached while the whole sequence fits the context (positions are absolute: a cropped window
        starts again at position 0, so it is recomputed whole)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        was_training = self.training
        self.eval()
        caches: list[list[torch.Tensor]] = [[] for _ in self.blocks]
        try:
            for _ in range(max_new_tokens):
                if idx.size(1) <= self.cfg.ctx_len:
                    logits = self.next_logits(idx[:, -1:] if caches[0] else idx, caches)  # (B, V)
                else:
                    logits = self.next_logits(idx[:, -self.cfg.ctx_len:])  # (B, V)
                logits = logits.float() / temperature  # (B, V)
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)  # (B, V)
                nxt = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
                idx = torch.cat([idx, nxt], dim=1)  # (B, T+1)
        finally:
            self.train(was_training)
        return idx


def build_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    """Deterministic init from the seed (the initial global version 0)."""
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(seed)
    resid_std = INIT_STD / math.sqrt(2 * cfg.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():  # stable order -> the same bits for the same seed
            if name.endswith(".proj.weight"):
                nn.init.normal_(p, 0.0, resid_std, generator=gen)
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, INIT_STD, generator=gen)
            elif name.endswith(".weight"):  # LayerNorm gain
                nn.init.ones_(p)
            else:  # LayerNorm bias
                nn.init.zeros_(p)
    return model


def param_names(model: nn.Module) -> list[str]:
    """Parameter names in their stable order (tied weights once): the tensor order of every delta."""
    return [name for name, _ in model.named_parameters()]


def model_fingerprint(model: nn.Module, cfg: ModelConfig) -> str:
    """Stable hash of parameter names, shapes and the model config."""
    shapes = [[name, list(p.shape)] for name, p in model.named_parameters()]
    blob = json.dumps({"params": shapes, "config": cfg.model_dump()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def get_flat_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> fp32 CPU clone of each parameter (tied weights appear once), in param order. From an
    accelerator: one device-to-host transfer of all of them into pinned memory, then split."""
    named = list(model.named_parameters())
    if not named or named[0][1].device.type == "cpu":
        return {name: p.detach().to(device="cpu", dtype=torch.float32).contiguous().clone()
                for name, p in named}
    with torch.no_grad():
        flat = torch.cat([p.detach().float().reshape(-1) for _, p in named])
        host = torch.empty(flat.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(flat)
    out, offset = {}, 0
    for name, p in named:
        out[name] = host[offset:offset + p.numel()].view(p.shape).clone()
        offset += p.numel()
    return out


def set_params(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy the given tensors into the model's parameters (dtype/device converted).

    Raises ValueError (and changes nothing) when names or shapes differ from the model's.
    """
    own = dict(model.named_parameters())
    if set(own) != set(params):
        missing, extra = sorted(set(own) - set(params)), sorted(set(params) - set(own))
        raise ValueError(f"parameter names differ: missing {missing}, unexpected {extra}")
    for name, p in own.items():
        if tuple(params[name].shape) != tuple(p.shape):
            raise ValueError(f"parameter {name}: shape {tuple(params[name].shape)} != {tuple(p.shape)}")
    with torch.no_grad():
        first = next(iter(own.values()), None)
        if first is not None and first.device.type != "cpu":  # one host-to-device transfer of everything
            host = torch.cat([params[n].detach().float().reshape(-1) for n in own]).pin_memory()
            flat, offset = host.to(first.device, non_blocking=True), 0
            for p in own.values():
                p.copy_(flat[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
            return
        for name, p in own.items():
            p.copy_(params[name])

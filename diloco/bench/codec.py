"""`diloco bench codec`: encode/decode throughput and ratio of every codec on a real AdamW delta.

Contract: builds its own small torch model (no diloco.training), prints a table, writes JSON
{"reference": {...}, "codecs": {codec: {ratio, encode_mb_s, decode_mb_s, max_abs_error}}}.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import lz4.block
import numpy as np

if TYPE_CHECKING:
    import torch

from diloco.bench.harness import BenchResult, Opt, Table, benchmark
from diloco.storage.codec import CODECS, decode, encode, object_checksum

TARGETS = {"int8": {"ratio": 3.5, "mb_s": 1000.0}, "int4": {"ratio": 6.5, "mb_s": 1000.0}}


def _build_model(num_params: int) -> torch.nn.Module:
    import torch  # heavy: imported when the bench runs, not when the CLI starts

    """Embedding -> 3 MLP blocks -> vocab head; vocab chosen so the total is ~num_params."""
    d = 256 if num_params >= 4_000_000 else 64  # width: realistic matrices, shrinks for smoke tests
    mlp = 3 * (8 * d * d + 5 * d)
    vocab = max(64, (num_params - mlp) // (2 * d))
    layers: list[torch.nn.Module] = [torch.nn.Embedding(vocab, d)]
    for _ in range(3):
        layers += [torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)]
    layers.append(torch.nn.Linear(d, vocab))
    return torch.nn.Sequential(*layers)


def build_adamw_delta(num_params: int, num_steps: int, seed: int = 0) -> dict[str, np.ndarray]:
    import torch

    """A real pseudo-gradient: initial - final params after num_steps of AdamW on random tokens."""
    torch.manual_seed(seed)
    model = _build_model(num_params)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    vocab = model[0].num_embeddings
    for _ in range(num_steps):
        tokens = torch.randint(0, vocab, (8, 64))  # (B, T)
        logits = model(tokens[:, :-1])  # (B, T-1, V)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {k: (start[k] - v.detach()).numpy().astype(np.float32) for k, v in model.named_parameters()}


def _best_s(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _reference(delta: dict[str, np.ndarray], repeats: int) -> dict[str, float]:
    flat = np.concatenate([v.reshape(-1) for v in delta.values()])
    dst, raw = np.empty_like(flat), flat.tobytes()
    mb = flat.nbytes / 1e6
    packed = lz4.block.compress(raw, store_size=False)
    return {
        "copy_mb_s": mb / _best_s(lambda: np.copyto(dst, flat), repeats),
        "lz4_mb_s": mb / _best_s(lambda: lz4.block.compress(raw, store_size=False), repeats),
        "lz4_ratio": len(raw) / len(packed),
        "crc32_mb_s": mb / _best_s(lambda: zlib.crc32(raw), repeats),
        "object_checksum_mb_s": mb / _best_s(lambda: object_checksum(raw), repeats),
    }


def _measure_codec(delta: dict[str, np.ndarray], codec: str, repeats: int) -> dict[str, float]:
    mb = sum(v.nbytes for v in delta.values()) / 1e6

    def run_encode() -> bytes:
        return encode(delta, codec=codec, kind="delta", fingerprint="bench", meta={"seq": 0})

    data = run_encode()
    _, out = decode(data)
    err = max(float(np.abs(out[k] - v).max()) if v.size else 0.0 for k, v in delta.items())
    result = {
        "ratio": mb * 1e6 / len(data),
        "encode_mb_s": mb / _best_s(run_encode, repeats),
        "decode_mb_s": mb / _best_s(lambda: decode(data), repeats),
        "max_abs_error": err,
        "encoded_bytes": len(data),
    }
    target = TARGETS.get(codec)
    if target:
        result["targets_met"] = (
            result["ratio"] >= target["ratio"]
            and min(result["encode_mb_s"], result["decode_mb_s"]) >= target["mb_s"]
        )
    return result


def _table(results: dict[str, Any]) -> Table:
    ref = results["reference"]
    table = Table(f"codec on an AdamW delta: {results['num_params']:,} params, 1 thread",
                  ["codec", "ratio", "encode MB/s", "decode MB/s", "max |err|", "targets"])
    for codec, r in results["codecs"].items():
        met = {True: "met", False: "MISSED"}.get(r.get("targets_met"), "-")
        table.rows.append([codec, f"{r['ratio']:.2f}", f"{r['encode_mb_s']:,.0f}", f"{r['decode_mb_s']:,.0f}",
                           f"{r['max_abs_error']:.2e}", met])
    table.rows.append(["memcpy", "1.00", f"{ref['copy_mb_s']:,.0f}", "", "", ""])
    table.rows.append(["raw lz4", f"{ref['lz4_ratio']:.2f}", f"{ref['lz4_mb_s']:,.0f}", "", "", ""])
    return table


@benchmark()
def bench_codec(
    num_params: Annotated[int, Opt("--num-params", min=1000, help="Model size (~40 MB fp32).")] = 10_000_000,
    num_steps: Annotated[int, Opt("--steps", min=1, help="AdamW inner steps behind the delta.")] = 20,
    repeats: Annotated[int, Opt("--repeats", min=1, help="Timed repeats; the best counts.")] = 5,
) -> BenchResult:
    """Encode and decode a realistic AdamW delta with every codec; print a table."""
    import torch

    delta = build_adamw_delta(num_params, num_steps)
    torch.set_num_threads(1)  # the targets are per core
    results: dict[str, Any] = {
        "num_params": sum(v.size for v in delta.values()),
        "fp32_bytes": sum(v.nbytes for v in delta.values()),
        "reference": _reference(delta, repeats),
        "codecs": {codec: _measure_codec(delta, codec, repeats) for codec in CODECS},
    }
    results["targets_met"] = all(r.get("targets_met", True) for r in results["codecs"].values())
    return BenchResult(results, [_table(results)])

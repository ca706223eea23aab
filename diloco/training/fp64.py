"""fp64 arithmetic on fp32 tensors through one reusable fp64 buffer: sums of squares and accumulations
without a fresh fp64 copy (and its page faults) per tensor.

Contract: every result is bit-identical to the plain expressions it replaces — `sum_squares(t)` to
`(t.double() ** 2).sum()` (the same reduction over a same-shaped contiguous fp64 tensor; `** 2` is `x * x`)
and `add_scaled_(acc, t, w)` to `acc.add_(t.double(), alpha=w)` (elementwise, so chunking does not change
a bit); the buffer is scratch owned by one caller at a time, never shared between threads.
"""

from __future__ import annotations

import torch

# fp64 elements per chunk of an elementwise pass (8 MB; a multiple of any SIMD width)
CHUNK_ELEMENTS = 1 << 20


class Fp64Scratch:
    """A growable fp64 buffer; `take(n)` hands back its first n elements (contents undefined)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float64)

    def take(self, numel: int) -> torch.Tensor:
        if self._buf.numel() < numel:
            self._buf = torch.empty(0, dtype=torch.float64)  # release the old one before the larger alloc
            self._buf = torch.empty(numel, dtype=torch.float64)
        return self._buf[:numel]

    def release(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float64)


def sum_squares(value: torch.Tensor, scratch: Fp64Scratch) -> torch.Tensor:
    """The 0-d fp64 sum of value's squares: the bits of `(value.double() ** 2).sum()`."""
    buf = scratch.take(value.numel()).view(value.shape)
    buf.copy_(value)
    buf.mul_(buf)
    return buf.sum()


def add_scaled_(acc: torch.Tensor, value: torch.Tensor, weight: float, scratch: Fp64Scratch) -> None:
    """acc (fp64) += weight * value (fp32) in place, chunk by chunk: the bits of
    `acc.add_(value.double(), alpha=weight)`."""
    flat_acc, flat = acc.view(-1), value.reshape(-1)
    n = flat.numel()
    for start in range(0, n, CHUNK_ELEMENTS):
        stop = min(n, start + CHUNK_ELEMENTS)
        buf = scratch.take(stop - start)
        buf.copy_(flat[start:stop])
        flat_acc[start:stop].add_(buf, alpha=weight)

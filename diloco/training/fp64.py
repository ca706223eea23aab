"""fp64 arithmetic on fp32 tensors through one reusable fp64 buffer: sums of squares and accumulations
without a fresh fp64 copy (and its page faults) per tensor.

Contract: every result is bit-identical to the plain expressions it replaces — `sum_squares(t)` to
`(t.double() ** 2).sum()` (the same reduction over a same-shaped contiguous fp64 tensor; `** 2` is `x * x`),
`sum_squares_chunked(t)` to the sum, in order from an fp64 zero, of that expression over the flat tensor's
consecutive NORM_CHUNK_ELEMENTS-element chunks, `add_scaled_(acc, t, w)` to `acc.add_(t.double(), alpha=w)`
and `quotient_fp32(acc, d)` to `(acc / d).to(torch.float32)` (elementwise, so chunking does not change a
bit); the buffer is scratch owned by one caller at a time, never shared between threads. `Arena` is memory
kept on purpose the other way: one block whose views a merge uses each round (a merger's fp64 sums, its
deltas' fp32 buffers) instead of faulting fresh pages in.
"""

from __future__ import annotations

import torch

# fp64 elements per chunk of an elementwise pass (8 MB; a multiple of any SIMD width)
CHUNK_ELEMENTS = 1 << 20
# fp32 values per chunk of a chunked sum of squares: its fp64 copy (512 KiB) stays in cache between the
# copy, the squaring and the sum, where a whole tensor's makes three passes over memory (~3.4x slower at
# 15.5M values)
NORM_CHUNK_ELEMENTS = 1 << 16


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


def sum_squares_chunked(value: torch.Tensor, scratch: Fp64Scratch) -> torch.Tensor:
    """The 0-d fp64 sum of value's squares a chunk at a time: each NORM_CHUNK_ELEMENTS-element chunk's
    `(chunk.double() ** 2).sum()` added, in order, to an fp64 zero. Not sum_squares' bits for a tensor of more
    than one chunk (another order of summation): a run's trust rules say which of the two its norms are."""
    flat = value.reshape(-1)
    n = flat.numel()
    buf = scratch.take(min(n, NORM_CHUNK_ELEMENTS))
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, n, NORM_CHUNK_ELEMENTS):
        part = buf[: min(n, start + NORM_CHUNK_ELEMENTS) - start]
        part.copy_(flat[start : start + part.numel()])
        part.mul_(part)
        total += part.sum()
    return total


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


def quotient_fp32(acc: torch.Tensor, divisor: float, scratch: Fp64Scratch,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """An fp32 tensor of acc's shape holding (acc / divisor) rounded to fp32, a chunk at a time through the
    scratch (it stays in cache: acc is read once, not divided into itself and read again): the bits of
    `(acc / divisor).to(torch.float32)`; fresh, or `out` (contiguous fp32 of acc's shape) overwritten."""
    if out is None:
        out = torch.empty(acc.shape, dtype=torch.float32)
    flat_acc, flat = acc.reshape(-1), out.view(-1)
    n = flat.numel()
    for start in range(0, n, NORM_CHUNK_ELEMENTS):
        stop = min(n, start + NORM_CHUNK_ELEMENTS)
        buf = scratch.take(stop - start)
        torch.div(flat_acc[start:stop], divisor, out=buf)
        flat[start:stop].copy_(buf)
    return out


class Arena:
    """One block of `dtype` kept between uses: each use's tensors are views of it laid one after another
    (`views`, valid until its next call: one user at a time), so a merge that runs every few seconds does not
    fault a fresh copy of its tensors into memory each round (~0.9 s a GB of fresh pages here, 0.1 s to zero a
    GB already held). It grows to the largest request and is held from then on — memory each use's peak held
    anyway; `release()` lets it go."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._block = torch.empty(0, dtype=dtype)

    def views(self, shapes: dict[str, tuple[int, ...]], zero: bool = False) -> dict[str, torch.Tensor]:
        """Tensors of `shapes` (name -> shape, in its order) in the block; `zero`: zeroed (the bits of fresh
        zeros), else their contents are undefined."""
        sizes = {name: torch.Size(shape).numel() for name, shape in shapes.items()}
        total = sum(sizes.values())
        if self._block.numel() < total:
            self._block = torch.empty(0, dtype=self.dtype)  # the old one released before the larger alloc
            self._block = torch.empty(total, dtype=self.dtype)
        out, start = {}, 0
        for name, shape in shapes.items():
            out[name] = self._block[start:start + sizes[name]].view(shape)
            start += sizes[name]
        if zero:
            self._block[:total].zero_()
        return out

    @property
    def held_bytes(self) -> int:
        return self._block.numel() * self._block.element_size()

    def release(self) -> None:
        self._block = torch.empty(0, dtype=self.dtype)

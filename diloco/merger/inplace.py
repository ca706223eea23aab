"""The merger's outer step tensor by tensor and chunk by chunk, in place: outer_step's bits without
whole-model temporaries.

Contract: `outer_step_in_place` returns what `step.outer_step` returns on the same inputs, bit for bit (the
update's bytes, the new global, the outer state, weights, norm, share): every piece of the outer step is
elementwise, so the optimizer runs on flat chunks of CHUNK_ELEMENTS (a multiple of any SIMD width, so each
op splits into vector and scalar parts exactly as on the whole tensor) and writes its results over the
inputs it has consumed. It consumes its inputs: `params` becomes the new global in place, `outer` (None:
zeros, a version without outer state) is emptied as its tensors are replaced, and the combined pseudo-
gradient is freed tensor by tensor. The caller must hold no other reference to them it still needs (after
a failure it reads the state again from the bucket).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from diloco.merger.step import GradientStream, OuterOptimizer, OuterState, StepResult
from diloco.storage.codec import Encoder
from diloco.training.fp64 import CHUNK_ELEMENTS, Fp64Scratch, sum_squares_chunked
from diloco.training.tensors import Tensors


def _chunks(numel: int) -> list[slice]:
    """Flat chunks covering 0..numel (one empty chunk for an empty tensor: its update still runs once)."""
    return [slice(start, min(numel, start + CHUNK_ELEMENTS))
            for start in range(0, max(numel, 1), CHUNK_ELEMENTS)]


class _Tensor:
    """One tensor's inputs, flat: the params, gradient, momentum, residual and pending of the step."""

    def __init__(self, name: str, params: Tensors, outer: OuterState | None, grad: Tensors | None) -> None:
        self.name, self.param = name, params[name]
        zeros = outer is None
        self.momentum = torch.zeros_like(self.param) if zeros else outer.momentum.pop(name)
        self.residual = torch.zeros_like(self.param) if zeros else outer.residual.pop(name)  # becomes exact
        self.pending = None if zeros or not outer.pending else outer.pending.pop(name)
        self.grad = None if grad is None else grad.pop(name)
        self.new_pending: torch.Tensor | None = None

    def piece(self, t: torch.Tensor | None, part: slice) -> dict[str, torch.Tensor]:
        return {} if t is None else {self.name: t.view(-1)[part]}

    def step(self, optimizer: OuterOptimizer, pending_share: float, merged_steps: int) -> tuple[float, float]:
        """The optimizer's update chunk by chunk; momentum and residual (now the exact update) overwritten;
        returns (share, pending_share) of the update."""
        share, new_share = optimizer.round_share(merged_steps), pending_share
        name = self.name
        for part in _chunks(self.param.numel()):
            state = OuterState(self.piece(self.momentum, part), self.piece(self.residual, part),
                               self.piece(self.pending, part), pending_share)
            grad = None if self.grad is None else self.piece(self.grad, part)
            update = optimizer.update(self.piece(self.param, part), state, grad, merged_steps)
            self.momentum.view(-1)[part].copy_(update.momentum[name])
            self.residual.view(-1)[part].copy_(update.exact[name])
            if update.pending:
                if self.new_pending is None:
                    self.new_pending = torch.empty_like(self.param)
                self.new_pending.view(-1)[part].copy_(update.pending[name])
            # every chunk's: the input's share, not these
            share, new_share = update.share, update.pending_share
        self.grad = self.pending = None
        return share, new_share


def _ship(encoder: Encoder, name: str, param: torch.Tensor, exact: torch.Tensor,
          scratch: Fp64Scratch) -> torch.Tensor:
    """Tensor `name`'s exact update quantized into the encoder, its shipment (the codec's own decode of the
    stream just encoded) added to the param and taken off `exact` (which becomes the residual); the shipment's
    fp64 sum of squares."""
    # the stream of a shuffled or quantized codec is a fresh array, never a view of `exact`
    source = exact.numpy() if encoder.shuffle or encoder.codec != "fp32" else exact.numpy().copy()
    raw = encoder.add(name, source)
    shipped = torch.from_numpy(encoder.shipped(name, tuple(exact.shape), raw))
    del raw, source
    param.add_(shipped)
    exact.sub_(shipped)  # the residual: exact - shipped
    return sum_squares_chunked(shipped, scratch)  # in cache: one chunk's fp64 copy, not the tensor's


def outer_step_in_place(params: Tensors, outer: OuterState | None, stream: GradientStream, fingerprint: str,
                        optimizer: OuterOptimizer,
                        finished: tuple[Tensors | None, dict[str, float]] | None = None) -> StepResult:
    """outer_step, one tensor at a time: the optimizer's update (chunked, in place), its quantized shipment
    (the codec's own decode of the stream it just encoded), the new global (params += shipped) and the
    residual (exact - shipped). `finished`: what stream.finish() returned, when the caller called it first
    (to free the fp64 sums before it reads the params).

    Two threads, the same bits: tensor i is shipped on a second thread (in params order, one at a time)
    while this one computes the update of tensor i + 1; nothing of one tensor touches another's."""
    scratch = Fp64Scratch()
    grad, normalised = stream.finish() if finished is None else finished
    encoder = Encoder(codec=optimizer.update_codec, kind="update", fingerprint=fingerprint,
                      meta={"version": stream.version + 1})
    momentum, residual, pending = {}, {}, {}
    share = optimizer.round_share(stream.steps)
    pending_share = 0.0 if outer is None else outer.pending_share
    new_share = pending_share
    with ThreadPoolExecutor(1, thread_name_prefix="merge-ship") as shipper:
        shipping = []
        for name in list(params):
            t = _Tensor(name, params, outer, grad)
            share, new_share = t.step(optimizer, pending_share, stream.steps)
            momentum[name], residual[name] = t.momentum, t.residual  # the residual once shipped
            if t.new_pending is not None:
                pending[name] = t.new_pending
            shipping.append(shipper.submit(_ship, encoder, name, t.param, t.residual, scratch))
            del t
        total = torch.zeros((), dtype=torch.float64)  # the shipped update's sum of squares, in params order
        for squares in shipping:
            total += squares.result()  # a shipment's error (a non-finite update) is the step's
    return StepResult(encoder.finish(), params, OuterState(momentum, residual, pending, new_share),
                      normalised, float(torch.sqrt(total)), share, stream.merged_buffers())

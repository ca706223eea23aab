"""A learner as a torch.distributed world: N ranks in one process group (gloo on CPU, nccl on CUDA), the model
wrapped in DistributedDataParallel, rank 0 the only rank that touches the bucket.

Contract: `launch_world(...)` starts the ranks with torch's own launcher (torch.multiprocessing): one failure
domain — a rank that dies or raises ends every rank and the launch raises, so the supervisor (or the train
flow) restarts the learner as one; a collective that waits longer than `learner.collective_timeout_s` (a hung
rank) raises too. Rank 0 runs the Learner (join, probes, installs, publishing, checkpoints, status); the other
ranks run `follow()`: before every inner step rank 0 broadcasts a control word, and with it the parameters
when it changed them (an install, an abandoned phase), or everything — parameters, optimizer state, step,
data cursor — after its join. Every rank draws the learner's global batch and trains on its slice of it, so
the learner's batch and its tokens per step do not depend on N; loss and tokens are reduced across ranks.
A delta is still defined over the full fp32 tensors, so learners of any rank count interoperate.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.training.spec import slice_batch  # noqa: F401 - re-exported for the learner

log = logging.getLogger("diloco.world")

# bits of the control word rank 0 broadcasts before each step
STOP, PARAMS, FULL, RESET, CLOCK = 1, 2, 4, 8, 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class World:
    """This process's rank in the learner's process group, and the few collectives the learner needs."""

    def __init__(self, rank: int, size: int, device: str) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.pending = 0  # rank 0: what the next control word carries
        self.pids: list[int] = [os.getpid()]  # every rank's process id (a chaos plan may kill one)

    def gather_pids(self) -> None:
        pids = [self._where(torch.zeros(1, dtype=torch.int64)) for _ in range(self.size)]
        dist.all_gather(pids, self._where(torch.tensor([os.getpid()], dtype=torch.int64)))
        self.pids = [int(p.item()) for p in pids]

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _where(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self.device.startswith("cuda") else t

    # ---- control --------------------------------------------------------------------------------
    def control(self, word: int = 0) -> int:
        """Rank 0 sends `word` (its pending flags added); every rank returns the word."""
        t = self._where(torch.tensor([word | self.pending if self.leader else 0], dtype=torch.int64))
        dist.broadcast(t, 0)
        self.pending = 0
        return int(t.item())

    def params(self, model: nn.Module) -> None:
        """Rank 0's parameters into every rank's model (in place, named_parameters order)."""
        with torch.no_grad():
            for p in model.parameters():
                buf = self._where(p.detach().clone()) if self.device.startswith("cuda") else p.data
                dist.broadcast(buf, 0)
                if buf is not p.data:
                    p.copy_(buf)

    def json(self, obj: Any = None) -> Any:
        """Rank 0's JSON-able object on every rank (sent as UTF-8 bytes: no pickle between ranks either)."""
        data = json.dumps(obj).encode() if self.leader else b""
        n = self._where(torch.tensor([len(data)], dtype=torch.int64))
        dist.broadcast(n, 0)
        buf = torch.frombuffer(bytearray(data),
                               dtype=torch.uint8) if self.leader else torch.empty(int(n), dtype=torch.uint8)
        buf = self._where(buf)
        dist.broadcast(buf, 0)
        return obj if self.leader else json.loads(bytes(buf.cpu().tolist()).decode())

    def tensors(self, named: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Rank 0's named fp32 tensors on every rank (names and shapes first, then each tensor)."""
        shapes = self.json({k: list(v.shape) for k, v in named.items()} if self.leader else None)
        out = {}
        for name, shape in shapes.items():
            t = named[name].float().contiguous() if self.leader else torch.empty(shape, dtype=torch.float32)
            t = self._where(t)
            dist.broadcast(t, 0)
            out[name] = t.cpu()
        return out

    def reduce_step(self, loss: float, tokens: int) -> tuple[float, int, bool]:
        """(token-weighted mean loss over ranks, tokens over ranks, whether every rank's loss was finite)."""
        finite = torch.isfinite(torch.tensor(loss)).item()
        t = self._where(torch.tensor([loss * tokens if finite else 0.0, float(tokens),
                                      0.0 if finite else 1.0],
                                     dtype=torch.float64))
        dist.all_reduce(t)
        total, count, bad = t.tolist()
        return (total / count if count else float("nan")), int(count), bad == 0.0


def _rank_entry(rank: int, size: int, port: int, backend: str, timeout_s: float,
                target: Callable[[World], Any], threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{rank % torch.cuda.device_count()}"
    dist.init_process_group(backend, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        world = World(rank, size, device)
        world.gather_pids()
        target(world)
    finally:
        dist.destroy_process_group()
    # A rank that ended well leaves here, exit code 0. A forked rank inherits its parent's at-exit hooks;
    # under a Prefect flow run those include Prefect's services, whose drain fails in a fork (an
    # AssertionError in multiprocessing's teardown: exit code 1, and torch ended the other ranks mid-close).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_world(target: Callable[[World], Any], size: int, *, cuda: bool, timeout_s: float,
                 threads: int = 1) -> None:
    """Run `target(world)` on `size` ranks and wait; raises when any rank fails (the others are ended).
    On CPU the ranks are forked (the imports are paid once), on CUDA spawned (CUDA cannot be forked)."""
    import torch.multiprocessing as mp

    backend = "nccl" if cuda else "gloo"
    mp.start_processes(_rank_entry, args=(size, free_port(), backend, timeout_s, target, threads),
                       nprocs=size, join=True, start_method="spawn" if cuda else "fork")

"""The source of a user's spec, unlike the built-in GPT: an MLP regressing a fixed random function, its own
SGD optimizer and step schedule. The tests write it to a temporary folder (elsewhere than this repository)
and train it through the CLI, the Python API and the engine's objects.

Not a test module; tests import SPEC_SOURCE and write it to a file.
"""

SPEC_SOURCE = '''
"""A user's spec written outside the diloco repository: an MLP on synthetic data."""
import os
import time

import torch
from torch import nn

import diloco

IN, OUT = 8, 4


def target(x):  # the function to learn: fixed, the same in every process
    g = torch.Generator().manual_seed(99)
    w = torch.randn(IN, OUT, generator=g)
    return torch.tanh(x @ w)


class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, hidden), nn.GELU(), nn.Linear(hidden, OUT))
        # a buffer: not in the layout; merged (run.json `buffers`)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        return self.body(x)


def make_spec(hidden=16, batch=32, seed=7, log=None, nan_at=-1, lr=0.05, step_s=0.0):
    hidden = int(os.environ.get("USER_SPEC_HIDDEN", hidden))

    def batches(shard, num_shards, start):
        i = start
        if log:
            with open(log, "a") as f:
                f.write(f"open {shard} {num_shards} {start}\\n")
        while True:
            g = torch.Generator().manual_seed(seed * 1_000_003 + shard * 10_007 + i)
            x = torch.randn(batch, IN, generator=g)
            if step_s:
                time.sleep(step_s)  # a real model takes time per step; this one would take microseconds
            yield {"x": x, "y": target(x), "i": torch.tensor(i)}
            i += 1

    def loss(model, b):
        value = nn.functional.mse_loss(model(b["x"]), b["y"])
        if int(b["i"]) == nan_at:
            value = value * float("nan")
        return value, b["x"].shape[0]

    def eval_batches():
        g = torch.Generator().manual_seed(12345)
        out = []
        for _ in range(4):
            x = torch.randn(64, IN, generator=g)
            out.append({"x": x, "y": target(x), "i": torch.tensor(-2)})
        return out

    return diloco.TrainSpec(
        build_model=lambda: Net(hidden), batches=batches, loss=loss, eval_batches=eval_batches,
        build_optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9),
        lr_at=lambda step: min(1.0, (step + 1) / 10), metric_name="mse",
    )
'''

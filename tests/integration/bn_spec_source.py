"""The source of a user's spec whose model has BatchNorm (or, with bn=False, the same model without it): an
MLP regressing a fixed function of inputs far from zero mean and unit variance, so a BatchNorm layer evaluated
with its initial running statistics (mean 0, variance 1) predicts badly. The tests write it to a temporary
folder.

Not a test module; tests import BN_SPEC_SOURCE and write it to a file.
"""

BN_SPEC_SOURCE = '''
"""A user's spec with BatchNorm: an MLP on synthetic inputs of mean 3 and standard deviation 4."""
import torch
from torch import nn

import diloco

IN, OUT, MEAN, STD = 8, 2, 3.0, 4.0


def target(x):  # the function to learn: fixed, the same in every process
    w = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(99))
    return torch.tanh((x - MEAN) / STD @ w)


class Net(nn.Module):
    def __init__(self, hidden, bn):
        super().__init__()
        norm = [nn.BatchNorm1d(hidden)] if bn else []
        self.body = nn.Sequential(nn.Linear(IN, hidden), *norm, nn.ReLU(), nn.Linear(hidden, OUT))

    def forward(self, x):
        return self.body(x)


def make_spec(hidden=32, batch=32, seed=7, bn=True, lr=0.01):
    def draw(g, n):
        return MEAN + STD * torch.randn(n, IN, generator=g)

    def batches(shard, num_shards, start):
        i = start
        while True:
            x = draw(torch.Generator().manual_seed(seed * 1_000_003 + shard * 10_007 + i), batch)
            yield {"x": x, "y": target(x)}
            i += 1

    def loss(model, b):
        return nn.functional.mse_loss(model(b["x"]), b["y"]), b["x"].shape[0]

    def eval_batches():
        g = torch.Generator().manual_seed(12345)
        return [{"x": (x := draw(g, 128)), "y": target(x)} for _ in range(2)]

    return diloco.TrainSpec(
        build_model=lambda: Net(hidden, bn), batches=batches, loss=loss, eval_batches=eval_batches,
        build_optimizer=lambda params: torch.optim.AdamW(params, lr=lr), lr_at=lambda step: 1.0,
        metric_name="mse",
    )
'''

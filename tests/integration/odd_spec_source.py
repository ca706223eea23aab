"""The source of a user's spec whose model holds the awkward tensors: a 0-d parameter (a learned gain), odd
lengths, lengths one past a codec block, an empty parameter and a one-element bias as the very last tensor (a
regression head). The tests write it to a temporary folder and train it.

Not a test module; tests import ODD_SPEC_SOURCE and write it to a file.
"""

ODD_SPEC_SOURCE = '''
"""A regression MLP with every awkward tensor shape a user model can have."""
import torch
from torch import nn

import diloco

IN = 7  # odd


def target(x):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(IN, 1, generator=g)
    return torch.sin(x @ w) + 0.5


class Odd(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.inp = nn.Linear(IN, 13)  # 13 x 7 weight, 13 bias: odd lengths
        self.gain = nn.Parameter(torch.tensor(1.0))  # 0-d: a learned gain
        self.unused = nn.Parameter(torch.zeros(0, 3))  # 0 elements
        self.mid = nn.Linear(13, hidden)  # hidden = 257: one past a 256-value block
        self.head = nn.Linear(hidden, 1)  # the last tensor is the one-element bias

    def forward(self, x):
        h = torch.tanh(self.inp(x)) * self.gain
        return self.head(torch.tanh(self.mid(h)))


def make_spec(hidden=257, batch=32, seed=3, dtype="float32"):
    dtype = getattr(torch, dtype)  # bfloat16 / float16: the parameters' own dtype (deltas are fp32 anyway)

    def batches(shard, num_shards, start):
        i = start
        while True:
            g = torch.Generator().manual_seed(seed * 1_000_003 + shard * 10_007 + i)
            x = torch.randn(batch, IN, generator=g)
            yield x, target(x)
            i += 1

    def loss(model, b):
        return nn.functional.mse_loss(model(b[0].to(dtype)).float(), b[1]), b[0].shape[0]

    def eval_batches():
        g = torch.Generator().manual_seed(4321)
        xs = [torch.randn(128, IN, generator=g) for _ in range(2)]
        return [(x, target(x)) for x in xs]

    return diloco.TrainSpec(build_model=lambda: Odd(hidden).to(dtype), batches=batches, loss=loss,
                            eval_batches=eval_batches, metric_name="mse")
'''

"""Your model, your data, your loss: a character LSTM trained by diloco (README, "Train your own model")."""
import itertools
from pathlib import Path

import torch
from torch import nn

import diloco

DATA = torch.tensor(list(Path(__file__).read_bytes() * 40))  # any bytes: here this file, 40 times
CUT = int(len(DATA) * 0.9)  # the last 10% is held out


class CharLSTM(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.embed, self.lstm, self.head = nn.Embedding(256, hidden), nn.LSTM(hidden, hidden, batch_first=True), nn.Linear(hidden, 256)

    def forward(self, x):  # (B, T) bytes -> (B, T, 256) logits
        return self.head(self.lstm(self.embed(x))[0])


def windows(data, n, seq, seed):  # n random windows of seq + 1 bytes, a pure function of the seed
    starts = torch.randint(0, len(data) - seq - 1, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([data[s:s + seq + 1] for s in starts])


def make_spec(hidden: int = 64, batch: int = 16, seq: int = 64) -> diloco.TrainSpec:
    def batches(shard, num_shards, start):  # batch i of a shard depends only on (shard, i): resumable
        part = DATA[shard * CUT // num_shards:(shard + 1) * CUT // num_shards]
        return (windows(part, batch, seq, shard * 1_000_003 + i) for i in itertools.count(start))

    def loss(model, b):  # (mean loss, tokens it was computed on)
        return nn.functional.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()), b[:, 1:].numel()

    held = [windows(DATA[CUT:], 32, seq, -1 - i) for i in range(4)]
    return diloco.TrainSpec(build_model=lambda: CharLSTM(hidden), batches=batches, loss=loss,
                            eval_batches=lambda: held, metric_name="nats/byte")


if __name__ == "__main__":  # the learners import this file to find make_spec: keep the run under this guard
    summary = diloco.train(make_spec, config="tiny", learners=2, versions=10, storage="file://runs")
    print(f"held-out {summary['initial_eval_loss']:.3f} -> {summary['final_eval_loss']:.3f} nats/byte")

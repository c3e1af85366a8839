"""A training job whose parameter servers a test kills: ``hybridsync-run ... python fault_train.py PREFIX``.

Trains a small model with a sparse (``--dense``: dense) embedding for ``--steps`` steps under the strategy in
``HYBRIDSYNC_STRATEGY``, each rank on its own data. Every rank writes ``PREFIX.rank<r>.step``
after each step (so a test can strike mid-training), then ``PREFIX.rank<r>.pt`` (its final
parameters) and ``PREFIX.rank<r>.json`` (the servers replaced under it).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

import hybridsync as hs
from hybridsync.backends.ps import client as ps_client

parser = argparse.ArgumentParser()
parser.add_argument("prefix")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--sleep", type=float, default=0.2, help="seconds between steps (time for a test to strike)")
parser.add_argument("--dense", action="store_true", help="a dense embedding: every gradient takes the strategy's route")
args = parser.parse_args()

hs.init()
torch.manual_seed(0)
torch.set_num_threads(1)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(100, 8, sparse=not args.dense)
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 1)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(torch.cat([self.emb(ids), x], dim=1))))


model = Net()
optimizer = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters())
hs.broadcast_parameters(model.state_dict(), root_rank=0)
generator = torch.Generator().manual_seed(hs.rank())
ids = torch.randint(0, 100, (64,), generator=generator)
x = torch.randn(64, 8, generator=generator)
y = x[:, :1] * 2.0 - x[:, 1:2]
progress = f"{args.prefix}.rank{hs.rank()}.step"
losses = []
for step in range(args.steps):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(ids, x), y)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    with open(progress + ".tmp", "w") as handle:
        handle.write(str(step + 1))
    os.replace(progress + ".tmp", progress)
    time.sleep(args.sleep)
torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, f"{args.prefix}.rank{hs.rank()}.pt")
recoveries = ps_client.get_client().recoveries if ps_client.initialized() else []
with open(f"{args.prefix}.rank{hs.rank()}.json", "w") as handle:
    json.dump({"losses": losses, "recoveries": [{"server": r.server, "incarnation": r.incarnation,
                                                     "seconds": r.seconds} for r in recoveries]}, handle)

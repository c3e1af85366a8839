"""A user's training script as hybridsync sees it: plain loop, hybridsync.DistributedOptimizer.

    python tiny_train.py --steps 8

Trains a two-layer regression for ``--steps`` steps and prints the final loss; used by the
script-trial and autotune tests (the trial runner drives its optimizer through HYBRIDSYNC_TRIALS).
"""
import argparse

import torch

import hybridsync as hs

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

hs.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters())
hs.broadcast_parameters(model.state_dict(), root_rank=0)
generator = torch.Generator().manual_seed(hs.rank())
x = torch.randn(256, 32, generator=generator)
y = x[:, :1] * 2.0 - x[:, 1:2]
for step in range(args.steps):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
if hs.rank() == 0:
    print(f"tiny_train: {args.steps} steps, final loss {loss.item():.4f}", flush=True)

"""A user's training script as hybridsync sees it: plain loop, hybridsync.DistributedOptimizer.

    python tiny_train.py --steps 8 [--two-optimizers] [--rebuild]

Trains a two-layer regression for ``--steps`` steps and prints the final loss; used by the
script-trial and autotune tests (the trial runner drives its optimizer through HYBRIDSYNC_TRIALS).
"""
import argparse

import torch

import hybridsync as hs

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--two-optimizers", action="store_true",
                    help="each layer its own optimizer, the second layer's built last and stepped first")
parser.add_argument("--rebuild", action="store_true",
                    help="build the optimizer again (as after loading a checkpoint) and step the new one only")
args = parser.parse_args()

hs.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
layers = [[(n, p) for n, p in model.named_parameters() if n.startswith(prefix)] for prefix in ("0.", "2.")]
if not args.two_optimizers:
    layers = [layers[0] + layers[1]]
optimizers = [hs.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.05), named_parameters=named)
              for named in layers]
if args.rebuild:
    optimizers = [hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                          named_parameters=model.named_parameters())]
hs.broadcast_parameters(model.state_dict(), root_rank=0)
generator = torch.Generator().manual_seed(hs.rank())
x = torch.randn(256, 32, generator=generator)
y = x[:, :1] * 2.0 - x[:, 1:2]
for step in range(args.steps):
    for optimizer in optimizers:
        optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    for optimizer in reversed(optimizers):
        optimizer.step()
if hs.rank() == 0:
    print(f"tiny_train: {args.steps} steps, final loss {loss.item():.4f}", flush=True)

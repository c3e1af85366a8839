"""A small deterministic training script for the profiler: a sparse embedding and a few Linear layers.

Usage: python profile_train.py --steps N [--params OUT.pt] [--two-optimizers] [--rebuild] [--late-head]

Step k looks up ids ``(arange(BATCH) % UNIQUE_IDS) + (k % 10) * 50``: exactly UNIQUE_IDS
distinct rows of the embedding per step. Prints ``step k`` after each step and
``trained N steps`` at the end, so a test sees where a profiled run stopped. With
``--params`` the parameters are saved when the process ends, however it ends (the
finished profile ends it with ``SystemExit(0)`` from ``optimizer.step()``).
"""
from __future__ import annotations

import argparse

import torch

import hybridsync as hs

BATCH = 64
UNIQUE_IDS = 24
EMBEDDING_ROWS = 1000
WIDTH = 256


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(EMBEDDING_ROWS, 16, sparse=True)
        self.fc1 = torch.nn.Linear(16, WIDTH)
        self.fc2 = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(self.emb(ids)))
        return self.head(torch.relu(self.fc2(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--params", help="save the parameters here when the process ends")
    parser.add_argument("--two-optimizers", action="store_true", help="the embedding's own optimizer")
    parser.add_argument("--rebuild", action="store_true", help="build the optimizer again, step the new one only")
    parser.add_argument("--late-head", action="store_true", help="fine-tuning: the head joins after a step")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    hs.init()
    model = Model()
    named = list(model.named_parameters())
    if args.two_optimizers:  # the embedding by one, the dense layers by another: stepped dense first
        sparse = [(n, p) for n, p in named if n.startswith("emb.")]
        dense = [(n, p) for n, p in named if not n.startswith("emb.")]
        opts = [hs.DistributedOptimizer(torch.optim.SGD([p for _, p in part], lr=0.01), named_parameters=part)
                for part in (dense, sparse)]
    elif args.late_head:  # named whole, the head added by add_param_group after the first step
        opts = [hs.DistributedOptimizer(torch.optim.SGD([p for n, p in named if not n.startswith("head.")], lr=0.01),
                                        named_parameters=named)]
    else:
        opts = [hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=named)]
    if args.rebuild:  # built again over the same parameters (as after loading a checkpoint): the new one steps
        opts = [hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=named)]
    target = torch.randn(BATCH, 1)
    try:
        for step in range(args.steps):
            if args.late_head and step == 1:
                opts[0].add_param_group({"params": list(model.head.parameters())})
            ids = (torch.arange(BATCH) % UNIQUE_IDS) + (step % 10) * 50
            for opt in opts:
                opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(ids), target)
            loss.backward()
            for opt in opts:
                opt.step()
            print(f"step {step}", flush=True)
        print(f"trained {args.steps} steps", flush=True)
    finally:
        if args.params:
            torch.save(model.state_dict(), args.params)


if __name__ == "__main__":
    main()

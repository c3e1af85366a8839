"""Run under hybridsync-run (servers started) or mpirun (servers started beside it): train a
small classifier with ``hs.DistributedOptimizer`` under ASP, SSP and a ring+ASP mix.

Usage: python ps_training.py OUT_PREFIX   -> writes OUT_PREFIX.rank<R>.json
Rank 1 is slow (sleeps every step), so under SSP the servers must hold rank 0 back; the
servers' staleness counters are read at the end of each phase for the test to check.
"""
from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn as nn

import hybridsync as hs

STEPS = 12
PHASES = {
    "asp": {"default": {"route": "ps", "protocol": "asp"}},
    "ssp1": {"default": {"route": "ps", "protocol": "ssp", "staleness": 1}},
    # the first layer is ring all-reduced every step, the second is trained asynchronously on the servers
    "mixed": {"default": {"route": "ps", "protocol": "asp"},
              "variables": {"mixed.0.weight": {"route": "allreduce"}, "mixed.0.bias": {"route": "allreduce"}}},
}


def blobs() -> tuple[torch.Tensor, torch.Tensor]:
    """800 points of 4 well-separated classes in 10 dimensions (same on every rank)."""
    gen = torch.Generator().manual_seed(7)
    centers = torch.randn(4, 10, generator=gen) * 3
    labels = torch.randint(0, 4, (800,), generator=gen)
    return centers[labels] + torch.randn(800, 10, generator=gen), labels


def train(tag: str, data: torch.Tensor, labels: torch.Tensor) -> dict:
    from hybridsync.backends.ps.client import get_client
    rank = hs.rank()
    torch.manual_seed(rank)  # different initial weights: broadcast (or the servers) make them agree
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    named = [(f"{tag}.{name}", p) for name, p in model.named_parameters()]
    opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named,
                                  strategy={"version": 1, **PHASES[tag]})
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    shard = slice(rank * 300, (rank + 1) * 300)  # rows 600.. are the test set
    started = time.monotonic()
    for step in range(STEPS):
        batch = torch.arange(step * 30, step * 30 + 30) % 300
        opt.zero_grad()
        nn.functional.cross_entropy(model(data[shard][batch]), labels[shard][batch]).backward()
        opt.step()
        if rank == 1:
            time.sleep(0.1)
    seconds = time.monotonic() - started
    accuracy = (model(data[600:]).argmax(1) == labels[600:]).float().mean().item()
    hs.barrier()  # both ranks are done: the servers' counters now cover the whole phase
    return {"accuracy": accuracy, "seconds": seconds, "servers": get_client().server_counters()}


def main() -> None:
    hs.init()
    data, labels = blobs()
    results = {}
    for tag in PHASES:
        results[tag] = train(tag, data, labels)
    with open(f"{sys.argv[1]}.rank{hs.rank()}.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

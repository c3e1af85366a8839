"""A 2-rank mpirun job that hands ``hs.init`` an mpi4py communicator whose ranks are in reverse order.

``hs.init`` is ``hvd.init``, so ``hs.init(comm=...)`` must give Horovod that communicator: each
rank's Horovod rank is then one minus its world rank. One SGD step of a linear model on
rank-dependent data, with a strategy that partitions and merges, must give every rank the step a
single process computes on both ranks' data. Writes ``<prefix>.rank<world rank>.json``.
"""
from __future__ import annotations

import json
import sys

import torch
from mpi4py import MPI

import hybridsync as hs

STRATEGY = {"version": 1, "default": {"route": "allreduce", "algorithm": "ring"},
            "variables": {"fc.weight": {"route": "allreduce", "partitions": 2, "group": 0},
                          "fc.bias": {"route": "allreduce", "group": 0}}}


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)



def main(prefix: str) -> None:
    world = MPI.COMM_WORLD
    comm = world.Split(color=0, key=world.Get_size() - 1 - world.Get_rank())
    hs.init(comm=comm)
    torch.manual_seed(0)
    net = torch.nn.Module()
    net.fc = torch.nn.Linear(4, 2)
    reference = {name: p.detach().clone() for name, p in net.named_parameters()}
    opt = hs.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                  named_parameters=net.named_parameters(), strategy=STRATEGY)
    x, y = batch(hs.rank())
    torch.nn.functional.mse_loss(net.fc(x), y).backward()
    opt.step()
    # The same step on one process: the mean of the ranks' gradients.
    single = torch.nn.Linear(4, 2)
    single.load_state_dict({name.removeprefix("fc."): value for name, value in reference.items()})
    for rank in range(hs.size()):
        xs, ys = batch(rank)
        (torch.nn.functional.mse_loss(single(xs), ys) / hs.size()).backward()
    with torch.no_grad():
        expected = {f"fc.{name}": p - 0.1 * p.grad for name, p in single.named_parameters()}
    error = max((p.detach() - expected[name]).abs().max().item() for name, p in net.named_parameters())
    result = {"world_rank": world.Get_rank(), "rank": hs.rank(), "size": hs.size(),
              "comm_size": comm.Get_size(), "max_error": error}
    with open(f"{prefix}.rank{world.Get_rank()}.json", "w") as f:
        json.dump(result, f)
    hs.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

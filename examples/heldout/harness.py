"""The training loop the held-out example scripts share, written as a Horovod user writes one.

Each script gives its model, optimizer, a per-rank batch source and one training step; the
harness parses the common flags, picks whose ``DistributedOptimizer`` wraps the optimizer
(``--optimizer hybridsync|horovod``, the latter being plain ``horovod.torch``), trains, and
prints one summary line that benchmarks and tests read: the median step time over the second
half of the steps, the loss at the start and end, and whether every rank holds the same model.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn

Batch = tuple[torch.Tensor, ...]


def parameter_checksum(model: nn.Module) -> str:
    """A short digest of every parameter's bytes: equal on every rank iff the models agree."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()[:16]


def parse_args(description: str, batch_size: int, lr: float) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=batch_size, help="per rank")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--optimizer", choices=("hybridsync", "horovod"), default="hybridsync",
                        help="whose DistributedOptimizer wraps the optimizer (horovod: plain horovod.torch)")
    return parser.parse_args()


def train(name: str, args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
          batches: Callable[[int, int], Callable[[int], Batch]],
          train_step: Callable[[nn.Module, torch.optim.Optimizer, Batch], float]) -> None:
    """Wraps ``optimizer`` for the job, trains ``args.steps`` steps and prints the summary line.

    ``batches(rank, size)`` returns the rank's batch source, called with the batch size each step.
    """
    if args.optimizer == "horovod":
        import horovod.torch as hs
    else:
        import hybridsync as hs
    hs.init()
    # Adagrad's sparse steps build sparse tensors without checks (torch's default): say so, or torch
    # warns about it once per rank
    torch.sparse.check_sparse_tensor_invariants.disable()
    optimizer = hs.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    next_batch = batches(hs.rank(), hs.size())
    losses, seconds = [], []
    for step in range(args.steps):
        batch = next_batch(args.batch_size)
        started = time.perf_counter()
        losses.append(train_step(model, optimizer, batch))
        seconds.append(time.perf_counter() - started)
        if hs.rank() == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    checksums = hs.allgather_object(parameter_checksum(model))
    if hs.rank() == 0:
        window = min(20, len(losses))
        print(f"{name} on {hs.size()} ranks: median step {1e3 * statistics.median(seconds[len(seconds) // 2:]):.1f} "
              f"ms, loss {statistics.mean(losses[:window]):.3f} -> {statistics.mean(losses[-window:]):.3f}, "
              f"ranks' parameters {'agree' if len(set(checksums)) == 1 else 'DIFFER'}", flush=True)

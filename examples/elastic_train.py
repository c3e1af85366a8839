"""Elastic Horovod training under hybridsync's optimizer: workers may come and go mid-run.

    printf '#!/bin/sh\\necho localhost:2\\n' > hosts.sh && chmod +x hosts.sh
    horovodrun -np 2 --min-np 1 --max-np 2 --network-interface lo \\
        --host-discovery-script ./hosts.sh python examples/elastic_train.py

Change what ``hosts.sh`` prints (``localhost:1``, ``localhost:2``, more hosts) while it runs, or
kill a worker, and the job goes on in the new world. ``--network-interface`` is required:
without it horovodrun 0.28.1's elastic mode waits (up to ``--elastic-timeout``, 600 s) until
the discovery script lists two hosts (README, "Elastic training").

A small regression trained with momentum SGD through ``hs.elastic.run`` and
``hs.elastic.TorchState``, committing after every step. The default strategy (``STRATEGY``)
has a merge group, partitions, a hierarchical variable and a PS one, so every world change
re-plans for real and the last two fall back to ring all-reduce where the world cannot run
them (with a warning). ``--horovod`` runs the same job on Horovod's own optimizer and state,
for comparison. A step's batch depends only on (step, rank), so the whole run can be
replayed from the world size of each committed step (``replay``), which the state records
(``sizes``: it rolls back with the state).

``--out DIR`` (used by tests/test_elastic.py and benchmarks/elastic.py) writes
``pid.<host>.<local rank>.<pid>`` when a process starts, ``events.jsonl`` (rank 0: every
committed step's world size and time, every reset) and ``result.<rank>.json`` at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch

STRATEGY = {"version": 1, "default": {"route": "allreduce"}, "variables": {
    "0.weight": {"route": "allreduce", "partitions": 2, "group": 1},
    "0.bias": {"route": "allreduce", "group": 1},
    "2.weight": {"route": "allreduce", "algorithm": "hierarchical", "partitions": 2},
    "2.bias": {"route": "ps", "protocol": "bsp"}}}
LR, MOMENTUM = 0.05, 0.9


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def loss_of(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    """The loss of ``rank``'s batch at ``step`` (the same on every run)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 4, generator=generator)
    return torch.nn.functional.mse_loss(model(x), y)


def replay(sizes: Sequence[int]) -> torch.nn.Module:
    """The model a correct run ends with when its committed step ``s`` ran on ``sizes[s]`` ranks:
    one process, each step's gradient averaged over those ranks' batches."""
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step, size in enumerate(sizes):
        optimizer.zero_grad()
        (sum(loss_of(model, step, rank) for rank in range(size)) / size).backward()
        optimizer.step()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds of 'compute' per step")
    parser.add_argument("--strategy", default=None,
                        help="strategy file (default: $HYBRIDSYNC_STRATEGY, else the built-in STRATEGY)")
    parser.add_argument("--horovod", action="store_true", help="Horovod's own optimizer and TorchState")
    parser.add_argument("--out", type=Path, default=None, help="directory for pid, event and result files")
    args = parser.parse_args()
    if args.horovod:
        import horovod.torch as hs
    else:
        import hybridsync as hs
    hs.init()
    torch.set_num_threads(1)
    if args.out is not None:
        Path(args.out, f"pid.{os.environ.get('HOROVOD_HOSTNAME', 'localhost')}."
                       f"{os.environ.get('HOROVOD_LOCAL_RANK', '0')}.{os.getpid()}").touch()
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    named = model.named_parameters()
    strategy = args.strategy or (None if os.environ.get("HYBRIDSYNC_STRATEGY") else STRATEGY)
    optimizer = (hs.DistributedOptimizer(optimizer, named_parameters=named) if args.horovod else
                 hs.DistributedOptimizer(optimizer, named_parameters=named, strategy=strategy))

    def record(event: dict[str, Any]) -> None:
        if args.out is not None and hs.rank() == 0:
            with open(Path(args.out, "events.jsonl"), "a", encoding="utf-8") as log:
                log.write(json.dumps({**event, "time": time.time()}) + "\n")

    @hs.elastic.run
    def train(state) -> None:
        while state.step < args.steps:
            optimizer.zero_grad()
            loss = loss_of(model, state.step, hs.rank())
            loss.backward()
            optimizer.step()
            state.sizes = state.sizes + [hs.size()]  # a new list: the committed one must not change
            state.step += 1
            time.sleep(args.pause)
            state.commit()
            record({"step": state.step, "size": hs.size()})
            if hs.rank() == 0 and state.step % 50 == 0:
                print(f"step {state.step:4d} on {hs.size()} ranks  loss {loss.item():.4f}", flush=True)

    state = hs.elastic.TorchState(model=model, optimizer=optimizer, step=0, sizes=[])
    state.register_reset_callbacks([lambda: record({"reset": hs.size()})])
    record({"start": hs.size()})
    train(state)
    if args.out is not None:
        result = {"rank": hs.rank(), "size": hs.size(), "sizes": state.sizes,
                  "params": {name: p.detach().flatten().tolist() for name, p in model.named_parameters()},
                  "routes": [] if args.horovod else sorted({m.config.route_name for m in optimizer.plan.messages})}
        Path(args.out, f"result.{hs.rank()}.json").write_text(json.dumps(result))
    print(f"elastic_train: rank {hs.rank()} of {hs.size()} done after {state.step} steps", flush=True)


if __name__ == "__main__":
    main()

"""The evaluation task of Sync-Switch: scikit-learn's bundled digits, an MLP, PS-routed variables.

Run on every rank (``python -m hybridsync.syncswitch.digits CONFIGS.json OUT_PREFIX``): the
file lists ``TaskConfig``s, trained one after another in one job (a fresh model and optimizer
each; the job's start-up is paid once). Each rank trains on its shard of a fixed
1400-image training split for ``steps`` steps; rank 0 measures test accuracy (397 held-out
images) every ``eval_every`` of its steps. Every rank writes ``OUT_PREFIX.<name>.rank<r>.json``
with the wall-clock time of each of its steps; rank 0 adds its accuracy curve and the final
model's accuracy (under ASP: the servers' model, once every rank finished). Rank 0 touches
``OUT_PREFIX.<name>.started`` when a run's training begins and ``.done`` when it ended, so a
controller can run a straggler schedule during each run.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

NUM_TRAIN = 1400


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """One training run of the digits task."""

    name: str
    """Names the run's files."""
    strategy: dict[str, Any]
    """The strategy document (route ``ps`` and, maybe, a ``sync`` policy)."""
    steps: int = 300
    """Steps every rank runs (a Sync-Switch switch is a collective: the same on every rank)."""
    batch: int = 16
    """Images per rank and step."""
    hidden: int = 64
    """Width of the MLP's two hidden layers."""
    lr: float = 0.05
    """SGD learning rate (BSP's; a Sync-Switch policy scales it in ASP)."""
    momentum: float = 0.9
    """SGD momentum."""
    seed: int = 0
    """Initial weights and batch order."""
    eval_every: int = 10
    """Rank 0 measures test accuracy every this many of its steps."""


def load_digits_split() -> tuple[Any, Any, Any, Any]:
    """(train x, train y, test x, test y) as torch tensors; the split is fixed (seed 0)."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x = torch.tensor(data.data[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target[order], dtype=torch.int64)
    return x[:NUM_TRAIN], y[:NUM_TRAIN], x[NUM_TRAIN:], y[NUM_TRAIN:]


def make_model(hidden: int) -> Any:
    import torch.nn as nn
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def accuracy(model: Any, x: Any, y: Any) -> float:
    import torch
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def train(configs: list[TaskConfig], out_prefix: str) -> None:
    """One rank's runs (see the module docstring)."""
    import horovod.torch as hvd
    import torch

    import hybridsync as hs
    hs.init()
    torch.set_num_threads(1)
    data = load_digits_split()
    for config in configs:
        _train_one(hvd, hs, config, data, f"{out_prefix}.{config.name}")


def _train_one(hvd: Any, hs: Any, config: TaskConfig, data: tuple[Any, Any, Any, Any], prefix: str) -> None:
    import torch
    import torch.nn.functional as F
    rank, size = hvd.rank(), hvd.size()
    x_train, y_train, x_test, y_test = data
    x_mine, y_mine = x_train[rank::size], y_train[rank::size]
    torch.manual_seed(config.seed)
    model = make_model(config.hidden)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum),
                                        named_parameters=model.named_parameters(), strategy=config.strategy)
    gen = torch.Generator().manual_seed(1000 * config.seed + rank)
    hvd.barrier()
    if rank == 0:
        open(f"{prefix}.started", "w").close()
    began, times, curve = time.time(), [], []
    for step in range(config.steps):
        index = torch.randint(0, len(y_mine), (config.batch,), generator=gen)
        optimizer.zero_grad()
        F.cross_entropy(model(x_mine[index]), y_mine[index]).backward()
        optimizer.step()
        times.append(time.time())
        if rank == 0 and (step + 1) % config.eval_every == 0:
            curve.append((times[-1], accuracy(model, x_test, y_test)))
    hvd.barrier()  # every rank's last push is on the servers
    if rank == 0:
        open(f"{prefix}.done", "w").close()
    optimizer.pull_parameters()  # ASP/SSP: the servers' model (BSP: nothing to do)
    result: dict[str, Any] = {"rank": rank, "began": began, "times": times, "batch": config.batch}
    if rank == 0:
        result["curve"] = curve
        result["final_accuracy"] = accuracy(model, x_test, y_test)
    controller = optimizer.sync_controller
    if controller is not None:
        result["switches"] = [dataclasses.asdict(e) for e in controller.switches]
    with open(f"{prefix}.rank{rank}.json", "w") as handle:
        json.dump(result, handle)
    hvd.barrier()
    optimizer.close()  # release this run's keys on the servers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as handle:
        configs = [TaskConfig(**doc) for doc in json.load(handle)]
    train(configs, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run under ``hybridsync-run --num-servers K``: Sync-Switch's in-flight switches.

Usage: python syncswitch_worker.py OUT CASE [CASE ...]   (each rank writes OUT.rank<r>.json)

Cases:
- ``switch``: copy A trains under ``{"policy": "switch", "switch_at": 4}``, copy B under plain
  PS BSP, on the same data; the parameters after each of the first 4 steps (A's BSP
  segment) must be bitwise equal; A goes on under ASP for 4 more steps.
- ``elastic``: the last rank sleeps 6x longer per step during its steps 6-16 (an injected
  straggler); the elastic policy must go ASP and come back to BSP. Records the switches,
  a checksum of the parameters after every step (identical on every rank under BSP).
Every case records the switches each rank made and the servers' log of them.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn as nn

import hybridsync as hs

PS_BSP = {"version": 1, "default": {"route": "ps"}}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    return torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)


def one_step(model: nn.Module, opt: Any, step: int) -> float:
    x, y = batch(step)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def make(strategy: dict) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=list(model.named_parameters()), strategy=strategy)
    return model, opt


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def switches(opt: Any) -> list[dict]:
    return [{"step": e.step, "protocol": e.protocol, "reason": e.reason} for e in opt.sync_controller.switches]


def run_switch() -> dict:
    model_a, opt_a = make({**PS_BSP, "sync": {"policy": "switch", "switch_at": 4}})
    model_b, opt_b = make(PS_BSP)
    diffs = []
    for step in range(4):
        one_step(model_a, opt_a, step)
        one_step(model_b, opt_b, step)
        diffs.append(max((pa - pb).abs().max().item() for pa, pb in zip(model_a.parameters(), model_b.parameters())))
    at_switch = [p.detach().clone() for p in model_a.parameters()]
    for step in range(4, 8):
        one_step(model_a, opt_a, step)
    hvd.barrier()
    moved = max((p.detach() - p0).abs().max().item() for p, p0 in zip(model_a.parameters(), at_switch))
    return {"diffs": diffs, "moved_after_switch": moved,  # largest change: a sum's changes can cancel
            "protocols": sorted({m.config.protocol for m in opt_a.plan.messages}),
            "lr": opt_a.param_groups[0]["lr"], "momentum": opt_a.param_groups[0]["momentum"],
            "switches": switches(opt_a), "servers": opt_a.sync_controller.server_events()}


def run_elastic() -> dict:
    model, opt = make({**PS_BSP, "sync": {"policy": "elastic", "window": 3, "exit_after": 4}})
    straggler = hvd.rank() == hvd.size() - 1
    sums, protocols = [], []
    for step in range(1, 71):
        time.sleep(0.15 if straggler and 6 <= step <= 16 else 0.02)
        one_step(model, opt, step)
        sums.append(checksum(model))
        protocols.append(opt.sync_controller.protocol)
    hvd.barrier()
    return {"sums": sums, "protocols": protocols, "lr": opt.param_groups[0]["lr"], "switches": switches(opt),
            "servers": opt.sync_controller.server_events()}


def main() -> None:
    hs.init()
    results: dict[str, Any] = {"_world": {"size": hvd.size()}}
    for case in sys.argv[2:]:
        results[case] = run_switch() if case == "switch" else run_elastic()
    with open(f"{sys.argv[1]}.rank{hvd.rank()}.json", "w") as f:
        json.dump(results, f, indent=1)
    hvd.barrier()


if __name__ == "__main__":
    main()

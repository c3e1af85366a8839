"""Run under horovodrun/mpirun: switch strategies with ``set_strategy`` and compare with optimizers
built with the new strategy at the switch.

Usage: python switching.py OUT CASE [CASE ...]   (each rank writes OUT.rank<r>.json)

Two copies of one model train on the same data (different on every rank). Copy A has one
optimizer whose strategy is swapped with ``set_strategy`` at each phase; copy B gets, at each
phase, a new ``DistributedOptimizer`` built with that phase's strategy, the previous one's
state loaded into it, the previous one's router closed (a job that used the new strategy
from that step on). Both live in one job, so this is also the "second optimizer" case.
Under ASP, ranks take turns stepping (a barrier between turns), so ASP's result does not
depend on timing and the two copies must agree exactly too.

Cases:
- a phase list from PHASES: the parameters of A and B after every phase, the time each
  ``set_strategy`` took, the servers' key namespaces after each switch and phase, and how
  many backends hold the hierarchical groups;
- ``errors``: ``set_strategy`` with gradients in flight; ranks passing different strategies
  (the error, on every rank, and how long it took); a step with the kept plan afterwards.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn as nn

import hybridsync as hs
from hybridsync.backends.hierarchical import groups as node_groups

STEPS_PER_PHASE = 3


def strategy(default: dict, variables: dict | None = None) -> dict:
    return {"version": 1, "default": default, "variables": variables or {}}


RING = None
RING_PARTS_GROUPS = strategy({"route": "allreduce"}, {"emb.weight": {"route": "allreduce", "partitions": 3},
                                                      "fc1.weight": {"route": "allreduce", "group": 1},
                                                      "fc1.bias": {"route": "allreduce", "group": 1}})
RING_REGROUPED = strategy({"route": "allreduce"}, {"fc2.weight": {"route": "allreduce", "group": 1},
                                                   "fc2.bias": {"route": "allreduce", "group": 1}})
"""Message ``hybridsync.group1.shard0`` again, with other variables (another size) than in RING_PARTS_GROUPS."""
HIER = strategy({"route": "allreduce", "algorithm": "hierarchical"},
                {"emb.weight": {"route": "allreduce", "algorithm": "hierarchical", "partitions": 2},
                 "fc2.weight": {"route": "allreduce", "algorithm": "hierarchical", "group": 2},
                 "fc2.bias": {"route": "allreduce", "algorithm": "hierarchical", "group": 2}})
PS_BSP = strategy({"route": "ps"}, {"emb.weight": {"route": "ps", "partitions": 2},
                                    "fc1.weight": {"route": "ps", "group": 1}, "fc1.bias": {"route": "ps", "group": 1},
                                    "fc2.weight": {"route": "allreduce"}})
ASP = strategy({"route": "ps", "protocol": "asp"}, {"emb.weight": {"route": "ps", "protocol": "asp",
                                                                   "partitions": 2}})
NAMED = {"ring": RING, "ring_parts_groups": RING_PARTS_GROUPS, "ring_regrouped": RING_REGROUPED, "hier": HIER,
         "ps_bsp": PS_BSP, "asp": ASP}

PHASES = {
    # Every route and shape after every other one it can follow here (PS ones need servers).
    "all_routes": ["ring", "hier", "ps_bsp", "ring_parts_groups", "ring_regrouped", "asp", "ps_bsp", "hier", "asp",
                   "ring"],
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(ids).mean(dim=1))))


def make_optimizer(model: nn.Module, name: str) -> Any:
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return hs.DistributedOptimizer(base, named_parameters=list(model.named_parameters()), strategy=NAMED[name])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    return torch.randint(0, 30, (6, 5), generator=gen), torch.randn(6, 4, generator=gen)


def one_step(model: nn.Module, opt: Any, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(model(data[0]), data[1]).backward()
    opt.step()


def train_phase(pairs: list[tuple[nn.Module, Any]], first_step: int, asynchronous: bool) -> None:
    """``STEPS_PER_PHASE`` steps of every (model, optimizer); under ASP one rank at a time."""
    for step in range(first_step, first_step + STEPS_PER_PHASE):
        data = batch(step)
        if not asynchronous:
            for model, opt in pairs:
                one_step(model, opt, data)
            continue
        for turn in range(hvd.size()):
            if turn == hvd.rank():
                for model, opt in pairs:
                    one_step(model, opt, data)
            hvd.barrier()


def server_namespaces() -> list[str] | None:
    """Namespaces of every key on the servers (``None`` without servers)."""
    from hybridsync.backends.ps import client
    if not client.initialized():
        return None
    return sorted({key.split("/", 1)[0] for keys in client.get_client().server_key_names() for key in keys})


def placed_bytes() -> list[int] | None:
    """This worker's bytes of declared keys per server (``None`` without servers)."""
    from hybridsync.backends.ps import client
    return client.get_client().loads if client.initialized() else None


def uses_ps(opt: Any) -> bool:
    return any(m.config.route == "ps" for m in opt.plan.messages)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def run_phases(names: list[str]) -> dict:
    torch.manual_seed(0)
    model_a, model_b = Net(), Net()
    model_b.load_state_dict(model_a.state_dict())
    hvd.broadcast_parameters(model_a.state_dict(), root_rank=0)
    hvd.broadcast_parameters(model_b.state_dict(), root_rank=0)
    start = [p.detach().clone() for p in model_a.parameters()]
    opt_a, opt_b = make_optimizer(model_a, names[0]), make_optimizer(model_b, names[0])
    phases = []
    for index, name in enumerate(names):
        record: dict[str, Any] = {"strategy": name}
        if index > 0:
            closed = [opt_a._router.namespace, opt_b._router.namespace]
            began = time.perf_counter()
            opt_a.set_strategy(NAMED[name])
            record["switch_s"] = time.perf_counter() - began
            previous, opt_b = opt_b, make_optimizer(model_b, name)
            opt_b.load_state_dict(previous.state_dict())
            previous._router.close()  # the reference job has no earlier optimizer
            hvd.barrier()  # every rank released: the servers dropped the old keys
            record["closed_namespaces"] = closed
            record["servers_after_switch"] = server_namespaces()
            record["placed_bytes_after_switch"] = placed_bytes()
        record["namespaces"] = [opt_a._router.namespace, opt_b._router.namespace]
        record["ps_namespaces"] = sorted(ns for ns, opt in zip(record["namespaces"], (opt_a, opt_b)) if uses_ps(opt))
        record["hierarchical_group_users"] = node_groups.hierarchical_groups_in_use()
        train_phase([(model_a, opt_a), (model_b, opt_b)], index * STEPS_PER_PHASE, name == "asp")
        hvd.barrier()
        record["servers_after_steps"] = server_namespaces()
        record["max_abs_diff"] = max_diff(model_a, model_b)
        phases.append(record)
    moved = max((p - s).abs().max().item() for p, s in zip(model_a.parameters(), start))
    return {"phases": phases, "moved": moved}


def run_errors() -> dict:
    torch.manual_seed(0)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = make_optimizer(model, "ring")
    out: dict[str, Any] = {}
    data = batch(0)
    nn.functional.mse_loss(model(data[0]), data[1]).backward()
    try:
        opt.set_strategy(NAMED["ring_parts_groups"])
        out["in_flight"] = None
    except ValueError as e:
        out["in_flight"] = str(e)
    opt.step()
    mine = "ring_parts_groups" if hvd.rank() == 1 else "hier"
    began = time.perf_counter()
    try:
        opt.set_strategy(NAMED[mine])
        out["disagree"] = None
    except ValueError as e:
        out["disagree"] = str(e)
    out["disagree_s"] = time.perf_counter() - began
    out["kept_plan"] = opt.plan.fingerprint()
    one_step(model, opt, batch(1))  # the kept plan still runs on every rank
    out["after_error_step"] = True
    return out


def main() -> None:
    hs.init()
    if os.environ.get("DMLC_NUM_SERVER"):  # join the servers now: ASP phases step one rank at a time
        from hybridsync.backends.ps.route import joined_client
        joined_client()
    results: dict[str, Any] = {"_world": {"size": hvd.size(), "local_size": hvd.local_size()}}
    for case in sys.argv[2:]:
        results[case] = run_errors() if case == "errors" else run_phases(PHASES[case])
    with open(f"{sys.argv[1]}.rank{hvd.rank()}.json", "w") as f:
        json.dump(results, f, indent=1)
    hvd.barrier()


if __name__ == "__main__":
    main()

"""Run under horovodrun on a world where one level has a single member (one host of N ranks, or N
hosts of one rank): each case trains the same model with a hierarchical strategy and with its ring
twin (every ``algorithm: hierarchical`` made ``ring``), and rank 0 writes per case the largest
parameter difference, how far training moved the parameters, and whether hierarchical groups were
built (a hierarchical route that really ran builds them; the ring's way builds none).

Usage: python single_level.py OUT.json
"""
from __future__ import annotations

import json
import sys

import horovod.torch as hvd
import torch
import torch.nn as nn

import hybridsync as hs
from hybridsync.backends.hierarchical.groups import hierarchical_groups_in_use

STEPS = 3
HIER = {"route": "allreduce", "algorithm": "hierarchical"}
CASES = {
    # name: (optimizer keyword arguments, the variables' configs, sparse embedding)
    "per_variable": ({}, {"default": HIER}, False),
    "sum": ({"op": "Sum"}, {"default": HIER}, False),
    "predivide": ({"gradient_predivide_factor": 2.0}, {"default": HIER}, False),  # prescale 1/2, postscale 2
    "groups_partitions_fp16": ({}, {"variables": {
        "fc1.weight": {**HIER, "partitions": 2, "group": 1, "compression": "fp16"},
        "fc1.bias": {**HIER, "group": 1, "compression": "fp16"},
        "fc2.weight": {**HIER, "partitions": 3}, "emb.weight": {**HIER, "partitions": 2}}}, False),
    "sparse_embedding": ({}, {"default": HIER}, True),
}


class Net(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 8, sparse=sparse)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(ids).mean(dim=1))))


def as_ring(configs: dict) -> dict:
    """The strategy with every hierarchical all-reduce made a ring all-reduce, nothing else changed."""
    def ring(config: dict) -> dict:
        return {**config, "algorithm": "ring"} if config.get("algorithm") == "hierarchical" else config
    out = {key: ring(value) for key, value in configs.items() if key == "default"}
    if "variables" in configs:
        out["variables"] = {name: ring(config) for name, config in configs["variables"].items()}
    return out


def train(kwargs: dict, configs: dict, sparse: bool) -> tuple[list[torch.Tensor], int]:
    """Parameters after ``STEPS`` steps, and how many backends held hierarchical groups meanwhile."""
    torch.manual_seed(0)
    model = Net(sparse)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    kwargs = {**kwargs, "op": getattr(hs, kwargs["op"])} if "op" in kwargs else kwargs
    opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=list(model.named_parameters()), strategy=configs, **kwargs)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randint(0, 40, (6, 5), generator=gen)),
                               torch.randn(6, 4, generator=gen)).backward()
        opt.step()
    groups = hierarchical_groups_in_use()
    opt.close()
    return [p.detach().clone() for p in model.parameters()], groups


def main() -> None:
    hs.init()
    results: dict = {"_world": {"size": hvd.size(), "local_size": hvd.local_size(), "cross_size": hvd.cross_size()}}
    for name, (kwargs, configs, sparse) in CASES.items():
        hierarchical, groups = train(kwargs, configs, sparse)
        ring, _ = train(kwargs, as_ring(configs), sparse)
        torch.manual_seed(0)
        start = Net(sparse).state_dict().values()
        results[name] = {"max_abs_diff": max(float((h - r).abs().max()) for h, r in zip(hierarchical, ring)),
                         "moved": max(float((h - s).abs().max()) for h, s in zip(hierarchical, start)),
                         "hierarchical_groups": groups}
    if hvd.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""Run under ``hybridsync-run --num-servers 2 --partition-bytes 400``: two optimizers in one job
route a model with a sparse embedding through the parameter servers (BSP partitions, groups,
pinned servers, fp16, sparse parts; then ASP/SSP and a whole sparse variable). For each, write
what this rank's PS client placed and pushed, with what a torch-free prediction needs (model
description, strategy, compression, namespace, the servers' loads before it).

Usage: python ps_placement.py OUT.json   (rank 0 writes it)
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn as nn

import hybridsync as hs
from hybridsync.backends.ps import client as ps_client
from hybridsync.variables import variables_from_model

STEPS = 2
PS = {"route": "ps"}
PHASES = [
    ("none", {"default": {"route": "allreduce"}, "variables": {
        "emb.weight": {**PS, "partitions": 2, "group": 4}, "fc1.bias": {**PS, "group": 4},
        "fc1.weight": {**PS, "partitions": 3, "servers": [1, 0, 1], "compression": "fp16"},
        "fc2.weight": {**PS, "group": 5}, "fc2.bias": {**PS, "group": 5}}}),
    ("fp16", {"default": {**PS, "protocol": "asp"}, "variables": {
        "emb.weight": PS, "fc1.weight": {**PS, "protocol": "ssp", "staleness": 1, "partitions": 2}}}),
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(ids).mean(dim=1))))


def main(out: str) -> None:
    hs.init()
    torch.manual_seed(0)
    model = Net()
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hs.rank())
    reports = []
    for compression, strategy in PHASES:
        loads = ps_client.get_client().keys.loads if ps_client.initialized() else None
        opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), strategy={"version": 1, **strategy},
                                      compression=getattr(hs.Compression, compression))
        for _ in range(STEPS):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randint(0, 50, (6, 5), generator=gen)),
                                   torch.randn(6, 4, generator=gen)).backward()
            opt.step()
        client, namespace = ps_client.get_client(), opt._router.namespace
        mine = namespace + "/"
        reports.append({"strategy": {"version": 1, **strategy}, "compression": compression, "namespace": namespace,
                        "loads": loads, "placement": {k: s for k, s in client.placement.items() if k.startswith(mine)},
                        "pushes": {k: n for k, n in client.pushes.items() if k.startswith(mine)}})
    if hs.rank() == 0:
        variables = [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype, "sparse": v.sparse}
                     for v in variables_from_model(model).values()]
        with open(out, "w") as f:
            json.dump({"variables": variables, "partition_bytes": int(os.environ["BYTEPS_PARTITION_BYTES"]),
                       "num_servers": int(os.environ["DMLC_NUM_SERVER"]), "steps": STEPS, "phases": reports}, f)


if __name__ == "__main__":
    main(sys.argv[1])

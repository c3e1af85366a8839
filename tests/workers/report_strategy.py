"""Run under a launcher: build ``hs.DistributedOptimizer`` with no ``strategy=`` (so it reads
``HYBRIDSYNC_STRATEGY``, as a user's script would), take two steps and write what took effect.

Usage: python report_strategy.py OUT_PREFIX   (writes OUT_PREFIX.rank{r}.json)
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn as nn

import hybridsync as hs


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.fc = nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(tokens).mean(dim=1))


def main() -> None:
    hs.init()
    torch.manual_seed(0)
    model = Net()
    opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hs.rank())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randint(0, 64, (16, 4), generator=gen)).sum().backward()
        opt.step()
    from hybridsync.backends.ps import client
    routes = {p.var_name: m.config.route for m in opt.plan.messages for p in m.pieces}
    report = {"strategy_fingerprint": opt.strategy.fingerprint() if opt.strategy else None,
              "routes": routes,
              "ps_pushed_bytes": client.get_client().counters.pushed_bytes if client.initialized() else 0,
              "env": {k: os.environ.get(k) for k in ("HYBRIDSYNC_STRATEGY", "DMLC_NUM_SERVER",
                                                    "BYTEPS_PARTITION_BYTES", "HOROVOD_FUSION_THRESHOLD")}}
    with open(f"{sys.argv[1]}.rank{hs.rank()}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
